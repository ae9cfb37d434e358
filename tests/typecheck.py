"""Type-check the product as installed, under its one name: ``python -m tests.typecheck [mypy args]``.

mypy finds modules by their place on disk, and the repository's folders are not laid out under
``ckptstore/`` (``pyproject.toml`` maps them at install). So this builds the installed layout as
links in a temporary folder (``ckptstore/__init__.py`` from ``client/_ckptstore/``, ``client/``,
``service/`` with ``migrations/`` inside it) and runs ``mypy -p ckptstore`` there with the
project's settings; errors name the repository's own files.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def link_tree(where: Path) -> Path:
    """The installed layout of the package as links under ``where``; returns ``where``."""
    package = where / "ckptstore"
    service = package / "service"
    service.mkdir(parents=True)
    (package / "__init__.py").symlink_to(ROOT / "client" / "_ckptstore" / "__init__.py")
    (package / "client").symlink_to(ROOT / "client")
    for entry in (ROOT / "service").iterdir():
        if entry.name != "__pycache__":
            (service / entry.name).symlink_to(entry)
    (service / "migrations").symlink_to(ROOT / "migrations")
    return where


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``mypy -p ckptstore`` over the installed layout, with ``args``; its output names repository paths."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = link_tree(Path(scratch))
        done = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--exclude", "/_ckptstore/",
             "-p", "ckptstore", *args],
            cwd=tree, capture_output=True, text=True, env={"MYPYPATH": str(tree), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    return done


if __name__ == "__main__":
    result = run(*sys.argv[1:])
    print(result.stdout + result.stderr, end="")
    sys.exit(result.returncode)
