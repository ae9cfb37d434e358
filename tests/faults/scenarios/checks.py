"""What a store holds after a fault scenario, checked through a client.

Every listed version of each run is loaded and hashed; its listed step names the state it
must hold (see :mod:`tests.faults.scenarios.savers`). A listed version that does not load, or
loads other bytes, is partial; an acknowledged version that is not listed, or is partial, is
lost; version numbers below a run's highest that are not listed (and were not deleted on
purpose, ``deleted``) are gaps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ckptstore.client.api import Client
from ckptstore.service.errors import CheckpointError, NotFoundError
from tests.faults.scenarios.record import StoreFindings
from tests.stress.model import state_sha


def check_store(
    ckpt: Client,
    runs: Iterable[str],
    acknowledged: dict[tuple[str, int], str],
    expected_hash: Callable[[str, int], str],
    deleted: Iterable[tuple[str, int]] = (),
) -> StoreFindings:
    """Load every listed version of ``runs`` and compare; see the module docstring."""
    found = StoreFindings()
    good: dict[tuple[str, int], int] = {}  # version -> its listed step, where it loads as that step's state
    removed = set(deleted)
    for run in sorted(set(runs) | {run for run, _ in acknowledged}):
        try:
            versions = ckpt.versions(run)
        except NotFoundError:
            versions = []
        numbers = {info.version for info in versions}
        missing_numbers = sorted(
            n for n in set(range(1, max(numbers, default=0) + 1)) - numbers if (run, n) not in removed
        )
        if missing_numbers:
            found.gaps += len(missing_numbers)
            found.problems.append(f"{run}: version numbers {missing_numbers} are missing")
        found.committed += len(versions)
        for info in versions:
            problem = _load_problem(ckpt, run, info.version, info.step, expected_hash)
            if problem is None:
                good[(run, info.version)] = info.step or 0
            else:
                found.partial += 1
                found.problems.append(f"{run}@{info.version}: {problem}")
    for (run, version), sha in sorted(acknowledged.items()):
        if (run, version) not in good:
            found.lost += 1
            found.problems.append(f"{run}@{version} was acknowledged and does not load as saved")
        elif sha != expected_hash(run, good[(run, version)]):
            found.lost += 1
            found.problems.append(f"{run}@{version} holds another step than the one its client saved")
    return found


def _load_problem(
    ckpt: Client, run: str, version: int, step: int | None, expected_hash: Callable[[str, int], str]
) -> str | None:
    if step is None:
        return "listed without a step"
    try:
        loaded = ckpt.load(run, version).state_dict or {}
    except CheckpointError as exc:
        return f"does not load: {type(exc).__name__}: {exc}"
    if state_sha(loaded) != expected_hash(run, step):
        return f"loads other bytes than step {step}'s state"
    return None
