"""SIGKILL a saving client (embedded and over HTTP) and a server, then check the store.

Each mode kills at least 20 times at randomly chosen phases (see tests.stress.harness);
set CKPTSTORE_STRESS_SEED to replay a run. bench/stress.py runs the same with more kills.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.stress.harness import MODES, run_mode
from tests.stress.report import format_reports

KILLS = 20


@pytest.mark.parametrize("mode", MODES)
def test_killed_saves_leave_whole_versions_and_no_temp_files(mode: str, tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTSTORE_STRESS_SEED") or random.randrange(1 << 31))
    report = run_mode(mode, KILLS, seed, tmp_path)
    table = format_reports([report])
    print(table)
    assert report.violations == [], table
    assert report.kills >= KILLS, table
    # The checks ran, not only the kills: versions exist and all loaded, re-saves were compared.
    assert report.versions >= 1 and report.loads_verified >= report.versions, table
    assert report.resave_checks >= 1, table
    assert report.temp_after == 0, table
