"""What a kill run counted, and the tables bench/stress.py and the kill test print."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ModeReport:
    """Counts for one mode.

    ``saves_reported``: saves a victim completed and reported; ``versions``: versions listed at
    the end; ``loads_verified``: version loads compared bit by bit with the state of their
    step (new versions after each job, then all of them again at the end). ``store_temp_before``
    and ``client_temp_before``: temporary files (and client upload folders) found after the
    kills, summed; ``temp_after``: the same after cleanup (must be 0). ``orphan_blobs_*``: blobs
    stored by a save killed before it recorded them (verified intact; garbage collection owns
    them). ``resave_*``: re-saves of an interrupted step whose sent bytes were compared with
    what the store said it lacked; ``reused``: bytes a killed save had stored unreferenced
    that the re-save did not send again.
    """

    mode: str
    seed: int
    phases: list[str] = field(default_factory=list)
    kills: int = 0
    jobs: int = 0
    kills_by_phase: Counter[tuple[str, str]] = field(default_factory=Counter)
    saves_reported: int = 0
    versions: int = 0
    loads_verified: int = 0
    store_temp_before: int = 0
    client_temp_before: int = 0
    temp_after: int = 0
    orphan_blobs_seen: int = 0
    orphan_blobs_end: int = 0
    resave_checks: int = 0
    resave_bytes_sent: int = 0
    resave_bytes_expected: int = 0
    resave_bytes_reused: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)


def format_reports(reports: list[ModeReport]) -> str:
    """The summary table and the per-phase table."""
    rows = [
        (
            "MODE",
            "KILLS",
            "JOBS",
            "SAVES OK",
            "VERSIONS",
            "LOADS OK",
            "STORE TEMP",
            "CLIENT TEMP",
            "TEMP AFTER",
            "ORPHANS SEEN",
            "ORPHANS END",
            "RESAVES",
            "RESAVE SENT",
            "EXPECTED",
            "REUSED",
            "VIOLATIONS",
            "SECONDS",
        )
    ]
    for r in reports:
        rows.append(
            (
                r.mode,
                str(r.kills),
                str(r.jobs),
                str(r.saves_reported),
                str(r.versions),
                str(r.loads_verified),
                str(r.store_temp_before),
                str(r.client_temp_before),
                str(r.temp_after),
                str(r.orphan_blobs_seen),
                str(r.orphan_blobs_end),
                str(r.resave_checks),
                _mib(r.resave_bytes_sent),
                _mib(r.resave_bytes_expected),
                _mib(r.resave_bytes_reused),
                str(len(r.violations)),
                f"{r.seconds:.0f}",
            )
        )
    lines = _table(rows)
    lines.append("")
    phase_rows = [("MODE", "PHASE", "EXACT", "RACING")]
    for r in reports:
        for phase in r.phases:
            phase_rows.append(
                (r.mode, phase, str(r.kills_by_phase[(phase, "exact")]), str(r.kills_by_phase[(phase, "racing")]))
            )
    lines += _table(phase_rows)
    for r in reports:
        lines += [f"VIOLATION {v}" for v in r.violations]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    cells = [zip(row, widths, strict=True) for row in rows]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(row)) for row in cells]
