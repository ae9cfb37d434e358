"""Repository promises: README's commands are what CI runs, lint and types are clean, the demo runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import typecheck

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:]
    return [block.split("```")[0].strip() for block in blocks]


def test_ci_runs_exactly_the_test_command_in_readme() -> None:
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_demo_command_installs_runs_the_quickstart_and_serves() -> None:
    demo = readme_commands()[0]
    assert "torch==2.13.0" in demo and "ckptstore quickstart &&" in demo and demo.endswith("ckptstore serve")


@pytest.mark.slow  # runs the quickstart and the CLI in subprocesses
def test_quickstart_runs_on_a_fresh_embedded_store(tmp_path: Path) -> None:
    env = {**os.environ, "CKPTSTORE_HOME": str(tmp_path / "home"), "CKPTSTORE_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", "quickstart"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "identical weights" in done.stdout
    lines = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    dedup = [float(row[5].rstrip("%")) for row in lines]
    assert dedup[0] == 0.0 and all(d > 90.0 for d in dedup[1:]), done.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", "ls", "quickstart", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert listing.returncode == 0 and '"version": 3' in listing.stdout


def test_ruff_is_clean() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # type-checks the whole product (day to day: .venv/bin/python -m tests.typecheck)
def test_mypy_is_clean() -> None:
    done = typecheck.run()
    assert done.returncode == 0, done.stdout + done.stderr
