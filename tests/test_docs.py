"""README.md and docs/: the README's example runs as printed, every Python block parses, every
relative link leads to a file, and the MkDocs site builds with no warning."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted([README, *DOCS.glob("*.md")])
_PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(path: Path) -> list[str]:
    return _PYTHON.findall(path.read_text(encoding="utf-8"))


def test_the_readme_stays_short_and_has_one_complete_example() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    (example,) = python_blocks(README)
    assert "client.save(" in example and "client.load(" in example


@pytest.mark.slow  # runs the example in a subprocess (imports torch)
def test_the_readme_example_runs_as_printed(tmp_path: Path) -> None:
    (example,) = python_blocks(README)
    env = {**os.environ, "CKPTSTORE_HOME": str(tmp_path / "store"), "CKPTSTORE_DISABLE_PROGRESS_BARS": "1"}
    env.pop("CKPTSTORE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "saved version 1" in done.stdout and "resumed bit for bit" in done.stdout, done.stdout
    assert (tmp_path / "store" / "metadata.db").is_file()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_parses(path: Path) -> None:
    for block in python_blocks(path):
        ast.parse(block, filename=str(path))


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(path: Path) -> None:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            assert not target.startswith("file:"), target
            continue
        assert not target.startswith("/"), f"{path.name}: links must be relative: {target}"
        assert (path.parent / target.split("#", 1)[0]).exists(), f"{path.name}: no such file: {target}"


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "saving-and-loading" / "index.html").is_file()
