"""Run the fault scenarios at a larger scale and print what each counted.

The scenarios of tests/faults/test_scenarios.py (see tests/faults/scenarios/): PostgreSQL
stopped and restarted, the S3 link cut, the server and saving clients SIGKILLed, a full disk,
bit flips in blobs and metadata, gc at grace 0 beside saves. Prints one table: saves
attempted, versions committed and acknowledged, lost, partial, gaps, failed saves by error
class, 5xx answers by code, seconds. Exits 1 if anything acknowledged was lost, a version is
partial or missing, a 500 was answered or a failure was not a clean error.

    .venv/bin/python bench/faults.py                       # scale 4, a fresh seed
    .venv/bin/python bench/faults.py --scale 2 --seed 7 --scenarios database s3-link

Needs root (the disk-full scenario mounts a tmpfs; the database scenario runs PostgreSQL as
the ``postgres`` user).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the scenarios live in the tests package

os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"

from tests.faults.scenarios.record import ScenarioResult, format_results  # noqa: E402
from tests.faults.scenarios.runner import SCENARIOS, run_scenario  # noqa: E402


def broken(result: ScenarioResult) -> bool:
    """Whether ``result`` breaks an invariant no fault may break."""
    found = result.findings
    return bool(found.lost or found.partial or found.gaps or 500 in result.status_5xx or result.unclean)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=4, help="times the CI size of each scenario (default 4)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random, printed)")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--keep", action="store_true", help="keep the stores and logs for inspection")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-faults-"))
    # The servers' error logs and the clients' retry warnings go to a file, not over the table.
    logging.basicConfig(filename=workdir / "scenarios.log", level=logging.WARNING, force=True)
    for name in ("uvicorn", "uvicorn.error", "werkzeug", "ckptstore", "ckptstore.api", "ckptstore.client"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    print(f"seed {seed}, scale {args.scale}: {', '.join(args.scenarios)}; work in {workdir}", flush=True)
    results = []
    try:
        for name in args.scenarios:
            result = run_scenario(name, workdir, seed, args.scale)
            print(f"{name}: {result.seconds:.0f} s, {'BROKEN' if broken(result) else 'ok'}", flush=True)
            results.append(result)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(format_results(results))
    for result in results:
        if broken(result):
            print(result.describe())
    return 1 if any(broken(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
