"""Retention rules: which versions of a run a policy keeps (pure: no SQL, no torch).

A policy keeps the last N versions and the best K by one metric (lowest or highest). On top
of its rules, a tagged version is always kept, and so is the run's newest version: a commit
never removes the version it creates, and a policy never empties a run. A version is kept if
any of these keeps it; every other version is removed. A policy with neither N nor K set is no
policy at all and removes nothing.

Everything here works on plain numbers and dicts, so the client checks a policy before sending
it and the pages explain why each version is kept with the same rules the engine applies
(:mod:`service.catalog.retention` applies them in the database).

Ties in the metric go to the newer version, so a version's rank never depends on the order
versions arrived in, and a version outside the last N and the best K stays outside as versions
are added. Applying the policy at every commit therefore leaves exactly what applying it once to
every version ever committed would (with the same tags and policy).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.names import METRIC_PATTERN
from ckptstore.service.format.records import RetentionPolicy

Mode = Literal["min", "max"]
#: Why a version is kept: one of the last N, one of the best K, tagged, or the newest.
Reason = Literal["last", "best", "tagged", "newest"]
#: Upper bound of keep_last and keep_best (a policy keeping more is no policy in practice).
MAX_KEEP = 1_000_000
_METRIC_RE = re.compile(METRIC_PATTERN)


@dataclass(frozen=True)
class Policy:
    """The rules of a retention policy; all None is no policy."""

    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Mode | None = None

    @property
    def active(self) -> bool:
        """True when the policy has a rule, so it may remove versions."""
        return self.keep_last is not None or self.keep_best is not None

    @classmethod
    def of(cls, record: RetentionPolicy) -> Policy:
        """The rules of a policy record."""
        return cls(record.keep_last, record.keep_best, record.metric, record.mode)

    def describe(self) -> str:
        """The policy in words, e.g. 'keep the last 3 versions and the best 2 by loss (lowest),
        plus every tagged version and the newest'."""
        if not self.active:
            return "none (every version is kept)"
        rules = []
        if self.keep_last is not None:
            rules.append(f"the last {self.keep_last} version{'s' if self.keep_last != 1 else ''}")
        if self.keep_best is not None:
            better = "highest" if self.mode == "max" else "lowest"
            rules.append(f"the best {self.keep_best} by {self.metric} ({better})")
        return f"keep {' and '.join(rules)}, plus every tagged version and the newest"


def _check_count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KEEP:
        shown = "a larger number" if isinstance(value, int) and value.bit_length() > 64 else repr(value)[:40]
        raise InvalidInputError(f"{name} must be a whole number from 1 to {MAX_KEEP}, not {shown}")
    return value


def check_policy(
    keep_last: object = None, keep_best: object = None, metric: object = None, mode: object = None
) -> Policy:
    """Validate a policy's fields; ``mode`` defaults to 'min' when ``keep_best`` is set.

    Raises:
        InvalidInputError: a count is out of range, ``keep_best`` lacks a metric, or a metric or
            mode is given without ``keep_best``.
    """
    last = _check_count("keep_last", keep_last)
    best = _check_count("keep_best", keep_best)
    if best is None:
        if metric is not None or mode is not None:
            raise InvalidInputError("metric and mode only apply with keep_best: set keep_best too, or leave them out")
        return Policy(keep_last=last)
    if not isinstance(metric, str) or not _METRIC_RE.fullmatch(metric):
        raise InvalidInputError(
            f"keep_best needs the metric to rank by (e.g. metric='loss'), not {str(metric)[:80]!r}: "
            "a metric name is 1-128 characters from A-Z a-z 0-9 _ . / : -"
        )
    if mode not in (None, "min", "max"):
        raise InvalidInputError(f"mode must be 'min' (lower is better) or 'max', not {str(mode)[:40]!r}")
    chosen: Mode = "max" if mode == "max" else "min"
    return Policy(keep_last=last, keep_best=best, metric=metric, mode=chosen)


def metric_value(metrics: Mapping[str, Any], name: str) -> float | None:
    """The value of metric ``name``, or None when it is absent or not a finite number."""
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def keep_reasons(
    policy: Policy, versions: Mapping[int, Mapping[str, Any]], tagged: Collection[int]
) -> dict[int, list[Reason]]:
    """For each version (number -> its metrics), the rules that keep it; an empty list means removed.

    Without an active policy nothing is removed and there is no rule to name: every list is
    empty, so check :attr:`Policy.active` before reading an empty list as removed.
    """
    reasons: dict[int, list[Reason]] = {number: [] for number in sorted(versions)}
    if not policy.active or not versions:
        return reasons
    newest_first = sorted(versions, reverse=True)
    if policy.keep_last is not None:
        for number in newest_first[: policy.keep_last]:
            reasons[number].append("last")
    if policy.keep_best is not None and policy.metric is not None:
        sign = -1.0 if policy.mode == "max" else 1.0
        ranked = []
        for number in newest_first:
            value = metric_value(versions[number], policy.metric)
            if value is not None:
                ranked.append((sign * value, -number))
        for _, negated in sorted(ranked)[: policy.keep_best]:
            reasons[-negated].append("best")
    for number in set(tagged):
        if number in reasons:
            reasons[number].append("tagged")
    reasons[newest_first[0]].append("newest")
    return reasons


def versions_to_remove(policy: Policy, versions: Mapping[int, Mapping[str, Any]], tagged: Collection[int]) -> list[int]:
    """The versions ``policy`` removes, oldest first, from ``versions`` (number -> metrics).

    ``tagged`` holds the numbers of tagged versions, which are always kept.
    """
    if not policy.active:
        return []
    return [number for number, why in keep_reasons(policy, versions, tagged).items() if not why]


__all__ = [
    "MAX_KEEP",
    "Mode",
    "Policy",
    "Reason",
    "check_policy",
    "keep_reasons",
    "metric_value",
    "versions_to_remove",
]
