"""The project installs one import name, ``ckptstore``: no top-level ``client`` or ``service`` to be
shadowed by a user's own ``client.py``, or to overwrite another distribution's package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore import CLIENT_NAMES
from ckptstore import client as ckpt_client

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # builds a wheel
def test_a_non_editable_install_puts_one_import_name_in_site_packages(tmp_path: Path) -> None:
    target, source = tmp_path / "site-packages", tmp_path / "source"
    # A copy of what the build reads, so the build's own folders land beside it, not in the checkout.
    for name in ("client", "service", "migrations"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(source)],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    importable = sorted(
        p.name for p in target.iterdir() if (p.is_dir() and (p / "__init__.py").is_file()) or p.suffix == ".py"
    )
    assert importable == ["ckptstore"]
    package = target / "ckptstore"
    for module in ("__init__.py", "client/api.py", "service/store.py", "service/migrations/env.py"):
        assert (package / module).is_file(), module
    assert (package / "service" / "migrations" / "script.py.mako").is_file()
    assert not (package / "client" / "_ckptstore").exists()
    # The installed package imports from there, and its top names are the client's.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import ckptstore, ckptstore.service.store; "
        "from ckptstore import client; print(ckptstore.__file__); print(ckptstore.save is client.save)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe, str(target)], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.split() == [str(package / "__init__.py"), "True"]


def test_the_top_name_offers_exactly_the_clients_public_names() -> None:
    import ckptstore

    assert set(CLIENT_NAMES) == set(ckpt_client.__all__)
    assert ckptstore.save is ckpt_client.save and ckptstore.Client is ckpt_client.Client
    with pytest.raises(AttributeError):
        ckptstore.nothing_of_that_name  # noqa: B018


def test_importing_the_top_name_imports_neither_torch_nor_the_client() -> None:
    probe = (
        "import sys, ckptstore, ckptstore.service.settings; "
        "print('torch' in sys.modules, 'ckptstore.client' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
