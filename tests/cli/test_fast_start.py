"""Commands that touch no tensors never import torch, on an embedded store and over HTTP.

Each command runs as its own ``python`` process (as ``ckptstore`` runs), which reports at exit
whether torch (or numpy) was ever imported; the command must also have done its work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import client
from ckptstore.service.api.app import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.servers import running_server

ROOT = Path(__file__).resolve().parents[2]
# Prints, at exit, which heavy modules the command imported: after the command's own output.
HEAVY = ("torch", "numpy")
#: What a listing never needs: the manifest models, committing and compaction.
WRITE_SIDE = (
    "ckptstore.service.format.manifest",
    "ckptstore.service.catalog.commit",
    "ckptstore.service.reclaim.compaction",
)
PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('IMPORTED:' + ','.join(m for m in {watched!r} if m in sys.modules),"
    " file=sys.stderr))\n"
    "from ckptstore.client.cli import app\n"
    "app()\n"
)


def run_cli(env: dict[str, str], *args: str, watched: tuple[str, ...] = HEAVY) -> tuple[int, str, list[str]]:
    """Run ``ckptstore *args``; its exit code, stdout and which ``watched`` modules it imported."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(watched=watched), *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    marker = [line for line in done.stderr.splitlines() if line.startswith("IMPORTED:")]
    assert marker, done.stderr
    imported = [m for m in marker[-1].removeprefix("IMPORTED:").split(",") if m]
    return done.returncode, done.stdout + done.stderr, imported


def fill(ckpt: client.Client) -> None:
    """Three versions of a small model in run ``demo``."""
    model = torch.nn.Linear(4, 3)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save("demo", model, step=step, metrics={"loss": 1.0 / step})


# (arguments, text the output must hold): every command that reads or changes only metadata.
COMMANDS: list[tuple[tuple[str, ...], str]] = [
    (("ls",), "demo"),
    (("ls", "demo"), "VERSION"),
    (("ls", "demo", "--json"), '"version": 3'),
    (("show", "demo@2"), "bias"),
    (("diff", "demo@1", "demo@3"), "weight"),
    (("tag", "demo@2", "best"), "best"),
    (("untag", "demo", "best"), "best"),
    (("retention", "demo", "--keep-last", "2"), "keep"),
    (("rm", "demo@1", "--yes"), "deleted"),
    (("gc", "--grace", "0", "--dry-run"), ""),
    (("verify", "demo"), "verified"),
    (("db", "--help"), "upgrade"),
    (("serve", "--help"), "--port"),
]


def check_commands(env: dict[str, str]) -> None:
    for args, expected in COMMANDS:
        code, output, imported = run_cli(env, *args)
        assert code == 0, (args, output)
        assert expected.lower() in output.lower(), (args, output)
        assert imported == [], f"ckptstore {' '.join(args)} imported {imported}"


def test_metadata_commands_on_an_embedded_store_never_import_torch(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with client.Client(home=home) as ckpt:
        fill(ckpt)
    check_commands({"CKPTSTORE_HOME": str(home), "CKPTSTORE_URL": ""})


def test_metadata_commands_over_http_never_import_torch(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "server")
    store = Store.open_home(settings.home_path)
    try:
        with running_server(create_app(store, settings)) as url:
            with client.Client(url) as ckpt:
                fill(ckpt)
            check_commands({"CKPTSTORE_URL": url, "CKPTSTORE_HOME": str(tmp_path / "unused")})
    finally:
        store.close()


@pytest.mark.parametrize("args", [("ls",), ("ls", "demo"), ("ls", "demo", "--json")])
def test_listings_import_nothing_of_the_write_path(tmp_path: Path, args: tuple[str, ...]) -> None:
    home = tmp_path / "home"
    with client.Client(home=home) as ckpt:
        fill(ckpt)
    env = {"CKPTSTORE_HOME": str(home), "CKPTSTORE_URL": ""}
    code, output, imported = run_cli(env, *args, watched=WRITE_SIDE)
    assert code == 0, output
    assert "demo" in output or "VERSION" in output, output
    assert imported == []
    # The probe tells the difference: showing a version parses its manifest.
    code, output, imported = run_cli(env, "show", "demo@2", watched=WRITE_SIDE)
    assert code == 0, output
    assert "ckptstore.service.format.manifest" in imported


def test_a_command_that_saves_still_imports_torch(tmp_path: Path) -> None:
    # The probe tells the difference: `import` stores tensors, so it must load torch.
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(weights))
    code, output, imported = run_cli({"CKPTSTORE_HOME": str(tmp_path / "home")}, "import", str(weights), "base")
    assert code == 0, output
    assert "torch" in imported


@pytest.mark.parametrize("module", ["ckptstore.client", "ckptstore.client.connection", "ckptstore.client.cli"])
def test_the_torch_free_modules_import_without_torch(module: str) -> None:
    probe = f"import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; import {module}"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_listing_an_embedded_store_reads_its_file_without_sqlalchemy(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with client.Client(home=home) as ckpt:
        fill(ckpt)
        ckpt.save("other", torch.nn.Linear(2, 2))
        engine = [run.model_dump(mode="json") for run in ckpt.runs()]
    env = {"CKPTSTORE_HOME": str(home), "CKPTSTORE_URL": ""}
    code, output, imported = run_cli(env, "ls", "--json", watched=("sqlalchemy",))
    assert code == 0, output
    assert imported == []
    assert json.loads(output[: output.rindex("]") + 1]) == engine  # the engine's answer, to the byte
    with client.Connection(home=home) as connection:
        engine_versions = [v.model_dump(mode="json") for v in connection.versions("demo")]
    code, output, imported = run_cli(env, "ls", "demo", "--json", watched=("sqlalchemy",))
    assert code == 0 and imported == [], output
    assert json.loads(output[: output.rindex("]") + 1]) == engine_versions
    code, output, imported = run_cli(env, "ls", "missing", watched=("sqlalchemy",))
    assert code != 0 and "missing" in output and imported == ["sqlalchemy"]  # the engine says so
    # Where the direct reader does not apply (a server database named), the engine lists the runs.
    database = {**env, "CKPTSTORE_DATABASE_URL": f"sqlite:///{home / 'metadata.db'}"}
    code, output, imported = run_cli(database, "ls", "--json", watched=("sqlalchemy",))
    assert code == 0 and imported == ["sqlalchemy"], output
    assert json.loads(output[: output.rindex("]") + 1]) == engine
    # An invalid setting is refused as by every command, not skipped by the quick path.
    code, output, _ = run_cli({**env, "CKPTSTORE_PORT": "not a port"}, "ls")
    assert code != 0 and "CKPTSTORE_PORT" in output
