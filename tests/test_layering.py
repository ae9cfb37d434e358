"""The layers, one direction: the service never imports torch, fastapi or the client; the client
owns torch, in rooms by job (saving, loading, http, formats, distributed, integrations, cli) over
a floor of a dozen modules; the service in rooms by job (format, intake, catalog, reclaim, db,
blobs, api) over a floor of at most eight; no folder holds more than a dozen modules side by side,
every package says what it may import, and there are no import circles."""

from __future__ import annotations

import ast
import json
import os
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.import_graph import (
    ROOMS,
    arrows,
    circles,
    import_graph,
    imports_of,
    product_modules,
    report,
    room_of,
    third_party_imports,
)

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, pkgutil, sys
blocked = sys.argv[1].split(",")
for name in blocked:
    sys.modules[name] = None  # any import of these now raises ImportError
from ckptstore import service
names = [m.name for m in pkgutil.walk_packages(service.__path__, "ckptstore.service.")]
names = [n for n in names if sys.argv[2] == "all" or not n.startswith("ckptstore.service.api")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def probe(blocked: str, which: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, blocked, which], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_the_engine_imports_without_torch_fastapi_or_client() -> None:
    assert probe("torch,numpy,ckptstore.client,fastapi,starlette,uvicorn", "core") >= 15


def test_the_whole_service_imports_without_torch_or_client() -> None:
    assert probe("torch,numpy,ckptstore.client", "all") >= 25


#: The one reader of pickled bytes: an allow-list interpreter that never imports or calls what
#: a pickle names. Every other module that meets pickled data hands the bytes to it.
PICKLE_READER = "client/formats/pickled/reader.py"
#: The one writer of pickled files: an export to a format that is itself a pickle (a ``.pt``, a
#: Lightning ``.ckpt``, a Trainer's ``optimizer.pt``), of plain data checked before it is written.
PICKLE_WRITER = "client/formats/export_training/torch_file.py"
#: Ways Python code loads pickled data (or runs a checkpoint's code), none allowed in the product.
PICKLE_LOADERS = (
    "import pickle",
    "from pickle",
    "import _pickle",
    "Unpickler",
    "torch.load(",
    "torch.jit.load(",
    "pickle.load",
    "cPickle",
    "import dill",
    "import joblib",
    "import shelve",
    "import marshal",
    "allow_pickle=True",
    "_EmptyStateDictLoadPlanner",
    "FileSystemReader",
    "weights_only=False",
    "trust_remote_code=True",
    "AutoConfig.from_pretrained",
)


def test_one_reader_of_pickled_data_in_the_product() -> None:
    offenders = []
    for path in list((ROOT / "service").rglob("*.py")) + list((ROOT / "client").rglob("*.py")):
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {word}" for word in PICKLE_LOADERS if word in text]
        if "torch.save(" in text and str(path.relative_to(ROOT)) != PICKLE_WRITER:
            offenders.append(f"{path.relative_to(ROOT)}: torch.save(")
    assert offenders == []
    readers = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "client").rglob("*.py")
        if "def read_pickle(" in path.read_text() or "opcode" in path.read_text().lower()
    )
    assert readers == [PICKLE_READER]
    callers = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "client").rglob("*.py") if "read_pickle(" in path.read_text()
    )
    assert callers == ["client/formats/dcp/folder.py", PICKLE_READER, "client/formats/torch_save/files.py"]


# -- the command line's server commands, and the client over HTTP --------------------------------

#: Runs the ``ckptstore`` command line (argv after ``-c``) with torch, numpy and the client's
#: torch side unimportable, as in the server image: any import of them raises ImportError.
TORCH_FREE_CLI = """
import importlib.abc, sys
BLOCKED = ("torch", "numpy", "ckptstore.client.api")
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} may not be imported by the server's commands")
        return None
sys.meta_path.insert(0, Refuse())
from ckptstore.client.cli import app
app(sys.argv[1:], prog_name="ckptstore")
"""
#: The engine's modules and libraries a client over HTTP does not need.
ENGINE = (
    "sqlalchemy",
    "alembic",
    "ckptstore.service.store",
    "ckptstore.service.factory",
    "ckptstore.service.db",
    "ckptstore.service.catalog.retention",
)
_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
#: Bound on the server's start: far above what it takes, only so a hung child fails the test.
START_TIMEOUT = 120.0


def service_env(home: Path, **settings: str) -> dict[str, str]:
    """This process's environment without its CKPTSTORE_* variables, plus ``settings``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("CKPTSTORE_")}
    env.update(CKPTSTORE_HOME=str(home), PYTHONUNBUFFERED="1")
    env.update({f"CKPTSTORE_{name.upper()}": value for name, value in settings.items()})
    return env


def torch_free_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``ckptstore ARGS`` with torch, numpy and client.api unimportable."""
    return subprocess.run(
        [sys.executable, "-c", TORCH_FREE_CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.slow  # subprocesses with torch, numpy and client.api hidden
def test_serve_and_db_upgrade_run_without_torch_numpy_or_the_client_api(tmp_path: Path) -> None:
    database = tmp_path / "server.db"
    env = service_env(tmp_path / "home", database_url=f"sqlite:///{database}")
    helped = torch_free_cli(env, "serve", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--workers" in helped.stdout
    upgraded = torch_free_cli(env, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "upgraded from an empty database to" in upgraded.stdout and database.is_file()
    current = torch_free_cli(env, "db", "current")
    assert current.returncode == 0, current.stderr
    revision = upgraded.stdout.split()[-1]
    assert f"current: {revision}  head: {revision}" in current.stdout
    # Listing needs no tensors (nor torch) either.
    listed = torch_free_cli(env, "ls")
    assert listed.returncode == 0, listed.stderr
    # The check has teeth: a command that stores tensors fails here for want of torch.
    weights = tmp_path / "w.safetensors"
    header = b'{"w":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}'
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00\x00\x80?")  # a valid 1.0
    imported = torch_free_cli(env, "import", str(weights), "base")
    assert imported.returncode != 0 and "may not be imported" in imported.stderr


@pytest.mark.slow  # starts ckptstore serve in a subprocess
def test_ckptstore_serve_answers_over_http_without_torch(tmp_path: Path) -> None:
    env = service_env(tmp_path / "home", host="127.0.0.1", port="0")
    process = subprocess.Popen(
        [sys.executable, "-c", TORCH_FREE_CLI, "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read_output, name="serve-output", daemon=True).start()
    output: list[str] = []
    port = None
    try:
        while port is None:
            line = lines.get(timeout=START_TIMEOUT)
            assert line is not None, "ckptstore serve ended before serving:\n" + "".join(output)
            output.append(line)
            found = _RUNNING.search(line)
            port = int(found.group(1)) if found else None
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as answer:
            assert answer.status == 200
        with urllib.request.urlopen(f"{url}/v1/runs", timeout=10) as answer:
            assert answer.status == 200 and json.loads(answer.read()) == []
    finally:
        process.terminate()
        process.wait(timeout=60)


def engine_modules_after(opening: str, *args: str) -> list[str]:
    """Which of ENGINE a fresh interpreter holds after ``from ckptstore import client`` and ``opening`` (a client
    expression, closed after), with ``args`` as its ``sys.argv[1:]``."""
    probe = (
        "import sys\nimport ckptstore.client.api\nfrom ckptstore import client\n"
        f"client_ = {opening}\n"
        "client_.close()\n"
        "assert 'torch' in sys.modules\n"
        f"print(','.join(m for m in {ENGINE!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]


@pytest.mark.slow  # a subprocess saving and loading over HTTP
def test_a_client_over_http_imports_no_engine(tmp_path: Path) -> None:
    # Nothing listens on port 9: building a client over HTTP connects to nothing.
    assert engine_modules_after("client.Client('http://127.0.0.1:9')") == []
    # The probe has teeth: an embedded store is the engine itself.
    embedded = engine_modules_after("client.Client(home=sys.argv[1])", str(tmp_path / "home"))
    assert {"sqlalchemy", "ckptstore.service.store", "ckptstore.service.factory"} <= set(embedded)


# -- the client's rooms and the arrows between them --------------------------------------------
#
# Imports are read from the source with ast.walk over the whole module, so an import inside a
# function, or under ``if TYPE_CHECKING:``, counts as much as one at the top.

#: The floor's size: the Client and Connection, results, the store protocol, state flattening and
#: placement, and the small helpers they share.
FLOOR = {
    "api",
    "connection",
    "results",
    "store_protocol",
    "state",
    "jsonstate",
    "keys",
    "names",
    "placement",
    "tensors",
    "progress",
    "cyclic_gc",
}
#: Most modules side by side in one folder of the product: past a dozen, a folder becomes rooms
#: (size caps on files make flat files, not rooms).
MAX_MODULES_PER_FOLDER = 12
#: Most modules on the service's own floor: the store facade and what every room shares.
MAX_SERVICE_FLOOR = 8


def modules_in(folder: Path) -> list[str]:
    """The modules directly in ``folder``, its ``__init__`` left out."""
    return sorted(path.stem for path in folder.glob("*.py") if path.name != "__init__.py")


def package_folders(top: str) -> list[Path]:
    """``top`` and every package folder under it."""
    return [ROOT / top, *sorted(init.parent for init in (ROOT / top).rglob("__init__.py"))]


def test_the_import_reader_counts_imports_in_functions_and_under_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "a.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.b import Thing\n"
        "def later():\n    from . import c\n    import pkg.d.e\n    from pkg import name_in_init\n"
    )
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.d.e"}
    assert imports_of("pkg.a", source, known) == {"pkg", "pkg.b", "pkg.c", "pkg.d.e"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("top", ["client", "service"])
def test_no_import_circles(top: str) -> None:
    assert circles(import_graph(top)) == []


def test_the_store_is_a_facade_of_at_most_400_lines() -> None:
    assert len((ROOT / "service" / "store.py").read_text().splitlines()) <= 400


def test_the_room_report_names_every_room_with_its_lines() -> None:
    text = report()
    for room in ROOMS:
        assert re.search(rf"^\| {room} \| [1-9][0-9]* \|$", text, re.MULTILINE), room
    assert "circles: none" in text


def test_saving_and_loading_do_not_import_each_other() -> None:
    assert arrows("saving", {"loading"}) == []
    assert arrows("loading", {"saving"}) == []


def test_saving_and_loading_import_no_room_above_them() -> None:
    above = {"http", "formats", "distributed", "integrations", "cli"}
    assert arrows("saving", above) == []
    assert arrows("loading", above) == []


def test_the_http_transport_imports_no_torch_and_no_other_part_of_the_client() -> None:
    outside = sorted(
        f"{name} -> {target}"
        for name, targets in import_graph().items()
        if room_of(name) == "http"
        for target in targets
        if room_of(target) != "http"
    )
    assert outside == []
    heavy = {
        f"{name}: {library}"
        for name, path in product_modules("client").items()
        if room_of(name) == "http"
        for library in third_party_imports(path) & {"torch", "numpy"}
    }
    assert heavy == set()


def test_the_import_and_export_formats_import_neither_the_http_transport_nor_the_save_path() -> None:
    assert arrows("formats", {"http", "saving"}) == []


def test_the_sharded_path_imports_neither_the_client_package_nor_the_client_api() -> None:
    graph = import_graph()
    reaching = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if room_of(name) == "distributed"
        for target in targets & {"client", "client.api"}
    )
    assert reaching == []


def test_the_top_of_the_client_is_the_floor() -> None:
    """The modules directly in client/ are the twelve of FLOOR, and none but the Client (api)
    imports the save or load path, the formats, the sharded path, the plug-ins or the CLI."""
    assert {path.stem for path in (ROOT / "client").glob("*.py")} - {"__init__"} == FLOOR
    above = {"saving", "loading", "formats", "distributed", "integrations", "cli"}
    offenders = [edge for edge in arrows("", above) if not edge.startswith(("client.api ->", "client ->"))]
    assert offenders == []


@pytest.mark.parametrize("top", ["client", "service"])
def test_no_folder_holds_more_than_a_dozen_modules_side_by_side(top: str) -> None:
    crowded = {
        str(folder.relative_to(ROOT)): len(modules_in(folder))
        for folder in package_folders(top)
        if len(modules_in(folder)) > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}


def test_the_service_floor_holds_the_facade_and_at_most_eight_modules() -> None:
    floor = modules_in(ROOT / "service")
    assert "store" in floor and len(floor) <= MAX_SERVICE_FLOOR, floor


@pytest.mark.parametrize("top", ["client", "service", "migrations"])
def test_every_package_says_what_it_may_import(top: str) -> None:
    unsaid = [
        str(init.relative_to(ROOT))
        for init in sorted((ROOT / top).rglob("__init__.py"))
        if "may import" not in (ast.get_docstring(ast.parse(init.read_text())) or "").lower()
    ]
    assert unsaid == []


def test_nothing_in_the_service_imports_the_client_or_torch_even_inside_a_function() -> None:
    offenders = {
        f"{name}: {library}"
        for name, path in product_modules("service").items()
        for library in third_party_imports(path) & {"client", "torch", "numpy"}
    }
    # The one exception: the codec of tensors compressed at rest groups bytes and applies deltas with
    # numpy, imported when a payload is first encoded or decoded (never by serve, db or ls).
    assert offenders == {"service.format.encoding: numpy"}
