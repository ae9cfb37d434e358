"""SIGKILL saving clients and servers many times and print what the store looked like after.

The same loop as tests/stress/test_kill.py (see tests/stress/harness.py), with more kills,
split evenly over the three modes: embedded client, HTTP client, HTTP server. Prints a
summary per mode and the kills per phase; exits 1 if any invariant was broken.

    .venv/bin/python bench/stress.py                 # 200 kills
    .venv/bin/python bench/stress.py --kills 30 --seed 7 --modes embedded
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives in the tests package

os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"

from tests.stress.harness import MODES, run_mode  # noqa: E402
from tests.stress.report import format_reports  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=200, help="total kills, split over the modes (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random, printed)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--keep", action="store_true", help="keep the stores and logs for inspection")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-stress-"))
    print(f"seed {seed}, {args.kills} kills over {', '.join(args.modes)}; work in {workdir}", flush=True)
    reports = []
    try:
        for index, mode in enumerate(args.modes):
            kills = args.kills // len(args.modes) + (index < args.kills % len(args.modes))
            report = run_mode(mode, kills, seed + index, workdir / mode)
            summary = f"{report.kills} kills in {report.seconds:.0f} s, {len(report.violations)} violations"
            print(f"{mode}: {summary}", flush=True)
            reports.append(report)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(format_reports(reports))
    return 1 if any(r.violations for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
