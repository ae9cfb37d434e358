"""SIGKILL a saving client (embedded and over HTTP) and a server, then check the store.

Each mode kills at least 20 times at phases drawn from a seeded generator (see
tests.stress.harness): the seed is SEED unless CKPTSTORE_STRESS_SEED names another, and is
printed, so a failure replays. bench/stress.py runs the same with more kills and fresh seeds.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.stress.harness import MODES, Target, choose_target, run_mode
from tests.stress.report import format_reports

KILLS = 20
#: The seed of every run unless CKPTSTORE_STRESS_SEED names another.
SEED = 16


def stress_seed() -> int:
    """``$CKPTSTORE_STRESS_SEED`` when set, else :data:`SEED`."""
    value = os.environ.get("CKPTSTORE_STRESS_SEED", "").strip()
    if not value:
        return SEED
    try:
        return int(value)
    except ValueError:
        pytest.fail(f"CKPTSTORE_STRESS_SEED must be a whole number, not {value[:40]!r}")


@pytest.mark.slow  # 20 saves killed and the store checked after each: minutes for the server mode
@pytest.mark.parametrize("mode", MODES)
def test_killed_saves_leave_whole_versions_and_no_temp_files(mode: str, tmp_path: Path) -> None:
    seed = stress_seed()
    print(f"stress seed {seed} ({mode}); replay with CKPTSTORE_STRESS_SEED={seed}", flush=True)
    report = run_mode(mode, KILLS, seed, tmp_path)
    table = f"seed {seed}\n{format_reports([report])}"
    print(table)
    assert report.violations == [], table
    assert report.kills >= KILLS, table
    # The checks ran, not only the kills: versions exist and all loaded, re-saves were compared.
    assert report.versions >= 1 and report.loads_verified >= report.versions, table
    assert report.resave_checks >= 1, table
    assert report.temp_after == 0, table


def test_the_seed_is_fixed_unless_the_environment_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_STRESS_SEED", raising=False)
    assert stress_seed() == SEED
    monkeypatch.setenv("CKPTSTORE_STRESS_SEED", " 7 ")
    assert stress_seed() == 7
    monkeypatch.setenv("CKPTSTORE_STRESS_SEED", "seven")
    with pytest.raises(pytest.fail.Exception, match="whole number"):
        stress_seed()


@pytest.mark.parametrize("mode", MODES)
def test_a_seed_replays_the_same_kill_points(mode: str) -> None:
    def draws(seed: int) -> list[Target]:
        rng = random.Random(seed)
        return [choose_target(rng, mode) for _ in range(KILLS)]

    assert draws(SEED) == draws(SEED)
    assert draws(SEED) != draws(SEED + 1)
