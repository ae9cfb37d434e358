"""What a fault scenario counted, gathered while it runs and printed as one table.

A :class:`Tally` is shared by a scenario's saving clients (threads) and its driver: every
save attempted, every version a client was told was committed (acknowledged, with the hash
of the state it saved), every failed save by error class, every 5xx answer the clients saw
(retried or not) and every failure that was not a clean error of the store's error tree.
The driver waits on it (``wait_for``) rather than on timers. A :class:`ScenarioResult` is the
frozen outcome, with what the checks found in the store afterwards.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tests.stress.report import _table as format_rows

#: Bound on any wait for the clients: far above what a scenario needs, there so a hang fails.
WAIT_SECONDS = 120.0


class Tally:
    """Thread-safe counters of one scenario's clients."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.attempted = 0
        #: (run, version) -> hash of the state the client saved as it.
        self.acknowledged: dict[tuple[str, int], str] = {}
        self.failed: Counter[str] = Counter()
        self.failure_messages: list[str] = []
        self.status_5xx: Counter[int] = Counter()
        self.network_errors = 0
        self.unclean: list[str] = []

    def _update(self, change: Callable[[], None]) -> None:
        with self._changed:
            change()
            self._changed.notify_all()

    def attempt(self) -> None:
        """A save begins."""
        self._update(lambda: setattr(self, "attempted", self.attempted + 1))

    def acknowledge(self, run: str, version: int, sha: str) -> None:
        """A save returned: ``version`` of ``run`` holds the state hashed ``sha``."""
        self._update(lambda: self.acknowledged.__setitem__((run, version), sha))

    def fail(self, error: BaseException) -> None:
        """A save raised ``error``: counted by class; one outside the error tree is unclean."""
        from ckptstore.service.errors import CheckpointError

        name = type(error).__name__
        if isinstance(error, CheckpointError):
            self.failed_with(name, str(error), clean=True)
        else:
            self.failed_with(f"{type(error).__module__}.{name}", str(error), clean=False)

    def failed_with(self, name: str, message: str, *, clean: bool) -> None:
        """A save failed with the error class ``name``; ``clean``: one of the store's error tree."""

        def change() -> None:
            self.failed[name] += 1
            self.failure_messages.append(f"{name}: {' '.join(message.split())[:300]}")
            if not clean:
                self.unclean.append(f"{name}: {message[:300]}")

        self._update(change)

    def answered(self, status: int) -> None:
        """A client got an HTTP answer with ``status`` (only 5xx are kept)."""
        if status >= 500:
            self._update(lambda: self.status_5xx.update([status]))

    def network_error(self) -> None:
        """A client's request failed on the network (refused, reset, cut)."""
        self._update(lambda: setattr(self, "network_errors", self.network_errors + 1))

    def wait_for(self, condition: Callable[[Tally], bool], what: str) -> None:
        """Block until ``condition(self)`` holds; AssertionError naming ``what`` after :data:`WAIT_SECONDS`."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self), timeout=WAIT_SECONDS):
                raise AssertionError(f"waited {WAIT_SECONDS:.0f} s for {what}; counted so far: {self.summary()}")

    def outage_felt(self, mark: tuple[int, int]) -> bool:
        """Whether a 5xx answer or network error came after ``mark`` (a :meth:`mark` taken earlier)."""
        return self.mark() != mark

    def mark(self) -> tuple[int, int]:
        """The count of 5xx answers and network errors so far."""
        return sum(self.status_5xx.values()), self.network_errors

    def summary(self) -> str:
        """A one-line account of the counters."""
        return (
            f"attempted {self.attempted}, acknowledged {len(self.acknowledged)}, failed {dict(self.failed)}, "
            f"5xx {dict(self.status_5xx)}, network errors {self.network_errors}, unclean {len(self.unclean)}"
        )


@dataclass
class StoreFindings:
    """What the store holds after a scenario (see :mod:`tests.faults.scenarios.checks`).

    ``committed``: versions listed; ``lost``: acknowledged versions not listed or not loading
    bit for bit as saved; ``partial``: listed versions that do not load, or load other bytes
    than their step's state; ``gaps``: version numbers missing below a run's highest.
    """

    committed: int = 0
    lost: int = 0
    partial: int = 0
    gaps: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class ScenarioResult:
    """One scenario's outcome: the clients' counters, the store's findings, extra counts."""

    name: str
    seed: int
    scale: int
    attempted: int
    acknowledged: int
    failed: Counter[str]
    status_5xx: Counter[int]
    network_errors: int
    unclean: list[str]
    findings: StoreFindings
    seconds: float = 0.0
    #: Counts particular to the scenario (kills, flips detected, disk size), shown as notes.
    notes: dict[str, int] = field(default_factory=dict)
    failure_messages: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls, name: str, seed: int, scale: int, tally: Tally, findings: StoreFindings, **notes: int
    ) -> ScenarioResult:
        """The result of a scenario whose clients counted into ``tally``."""
        return cls(
            name, seed, scale, tally.attempted, len(tally.acknowledged), Counter(tally.failed),
            Counter(tally.status_5xx), tally.network_errors, list(tally.unclean), findings,
            notes=dict(notes), failure_messages=list(tally.failure_messages),
        )  # fmt: skip

    @property
    def failed_saves(self) -> int:
        """Saves that ended in an error."""
        return sum(self.failed.values())

    def describe(self) -> str:
        """The table row's content and every problem, for an assertion's message."""
        lines = [format_results([self])]
        lines += [f"store: {p}" for p in self.findings.problems[:20]]
        lines += [f"unclean: {u}" for u in self.unclean[:20]]
        lines += [f"failed: {m}" for m in self.failure_messages[:10]]
        return "\n".join(lines)


def _counts(counter: Counter[str] | Counter[int]) -> str:
    return ", ".join(f"{key} {n}" for key, n in sorted(counter.items(), key=lambda item: str(item[0]))) or "-"


def format_results(results: Sequence[ScenarioResult]) -> str:
    """The table bench/faults.py prints: one row per scenario."""
    rows = [
        ("SCENARIO", "ATTEMPTED", "COMMITTED", "ACKED", "LOST", "PARTIAL", "GAPS", "FAILED", "FAILED BY CLASS",
         "5XX BY CODE", "NET ERR", "UNCLEAN", "SECONDS", "NOTES"),
    ]  # fmt: skip
    for r in results:
        rows.append(
            (
                r.name, str(r.attempted), str(r.findings.committed), str(r.acknowledged), str(r.findings.lost),
                str(r.findings.partial), str(r.findings.gaps), str(r.failed_saves), _counts(r.failed),
                _counts(r.status_5xx), str(r.network_errors), str(len(r.unclean)), f"{r.seconds:.1f}",
                ", ".join(f"{k} {v}" for k, v in r.notes.items()) or "-",
            )
        )  # fmt: skip
    return "\n".join(format_rows(rows))
