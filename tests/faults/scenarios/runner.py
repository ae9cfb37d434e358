"""Every fault scenario by name, and the one way to run one: timed, in its own folder."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.faults.scenarios import bitflips, client_kill, database, disk_full, gc_loop, s3_link, worker_kill
from tests.faults.scenarios.record import ScenarioResult

Scenario = Callable[[Path, int, int], ScenarioResult]

#: Name -> ``run(workdir, seed, scale)``; scale 1 is the size CI runs.
SCENARIOS: dict[str, Scenario] = {
    "database": database.run,
    "s3-link": s3_link.run,
    "worker-kill": worker_kill.run,
    "client-kill": client_kill.run,
    "disk-full": disk_full.run,
    "bit-flips": bitflips.run,
    "gc-loop": gc_loop.run,
}


def run_scenario(name: str, workdir: Path, seed: int, scale: int = 1) -> ScenarioResult:
    """Run scenario ``name`` in ``workdir`` (created) and time it."""
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = SCENARIOS[name](folder, seed, scale)
    result.seconds = time.perf_counter() - started
    return result
