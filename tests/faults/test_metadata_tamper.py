"""Metadata changed behind the store is never loaded silently, and always fails ``ckptstore verify``.

A small model is saved at step 202 with loss 0.25. Then one piece of its stored metadata is
changed with SQL, as a disk fault or a hand edit would change it, on SQLite and on PostgreSQL:
a part body's key or tensor digest, the version's list of parts, a part's references, the
head's step, a listed metric or tensor count, the manifest digest itself. ``ckptstore verify``
(the real command, in a subprocess) exits 1 naming the version and each changed piece, and a
load raises IntegrityError naming the version wherever it reads the changed bytes; a load reads
no listed column, and returns the saved tensors and the manifest's step and metrics. Over a real
server the changed manifest is a 400 ``integrity`` answer the client raises as IntegrityError.
Hypothesis changes one character anywhere in a part body or the head: verify and load catch it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, delete, select, update

from ckptstore import client
from ckptstore.client.loading.verify import verify
from ckptstore.service.api import create_app
from ckptstore.service.db import Database
from ckptstore.service.db.models import PartBody, PartRef, Version, table
from ckptstore.service.errors import IntegrityError
from ckptstore.service.factory import open_store
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.manifest import Chunk, ManifestBody, TensorEntry
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import empty_tables
from tests.servers import running_server

_VERSIONS = table(Version)
_BODIES = table(PartBody)
_REFS = table(PartRef)
KEY = "model/0.weight"


def layered_model() -> torch.nn.Module:
    """24 small linear layers: 48 manifest entries, cut into several parts."""
    torch.manual_seed(3)
    return torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(24)])


@dataclass
class Saved:
    """A version saved by ``ckpt``; ``database`` is its metadata, changed behind the store's back."""

    ckpt: client.Client
    database: Database
    env: dict[str, str]
    state: dict[str, torch.Tensor]

    def change(self, how: Callable[[Connection], object]) -> None:
        """Change stored rows in a transaction of their own."""
        with self.database.engine.begin() as connection:
            how(connection)

    def verify_json(self, *args: str) -> tuple[int, dict[str, object]]:
        """``ckptstore verify --json`` in a subprocess: its exit status and report."""
        done = ckptstore(self.env, "verify", *args, "--json")
        return done.returncode, json.loads(done.stdout)


def ckptstore(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The ``ckptstore`` command, run as a user runs it."""
    command = [sys.executable, "-m", "ckptstore.client.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def saved(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Saved]:
    """A version saved into an embedded store on SQLite, or on PostgreSQL with local blobs."""
    home = tmp_path / "home"
    for name in ("CKPTSTORE_URL", "CKPTSTORE_TOKEN", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
        emptied = Database(url)
        empty_tables(emptied)
        emptied.dispose()
        monkeypatch.setenv("CKPTSTORE_DATABASE_URL", url)
        monkeypatch.setenv("CKPTSTORE_BLOBS", (home / "blobs").as_uri())
    model = layered_model()
    with client.Client() as ckpt:
        ckpt.save("run", model, step=202, metrics={"loss": 0.25})
        store = ckpt.transport
        assert isinstance(store, Store)
        yield Saved(ckpt, store.db, dict(os.environ), {k: v.clone() for k, v in model.state_dict().items()})


# -- the changes, each as a function of a connection to the store's database -----------------------


def _body_holding(connection: Connection, text: str) -> tuple[int, str]:
    rows = connection.execute(select(_BODIES.c.part_id, _BODIES.c.body)).all()
    (found,) = [(int(pid), body) for pid, body in rows if text in body]
    return found


def part_key(connection: Connection) -> None:
    pid, body = _body_holding(connection, f'"{KEY}"')
    changed = body.replace(f'"{KEY}"', '"model/0.wdight"')
    connection.execute(update(_BODIES).where(_BODIES.c.part_id == pid).values(body=changed))


def part_tensor_digest(connection: Connection) -> None:
    pid, body = _body_holding(connection, f'"{KEY}"')
    at = body.index('"digest":"', body.index(f'"{KEY}"')) + len('"digest":"')
    changed = body[:at] + ("1" if body[at] != "1" else "2") + body[at + 1 :]
    connection.execute(update(_BODIES).where(_BODIES.c.part_id == pid).values(body=changed))


def head_step(connection: Connection) -> None:
    head = connection.execute(select(_VERSIONS.c.manifest)).scalar_one()
    assert head.count('"step":202') == 1
    connection.execute(update(_VERSIONS).values(manifest=head.replace('"step":202', '"step":212')))


def listed_metric(connection: Connection) -> None:
    connection.execute(update(_VERSIONS).values(metrics={"loss": 0.26}))


def manifest_digest(connection: Connection) -> None:
    digest = connection.execute(select(_VERSIONS.c.manifest_digest)).scalar_one()
    connection.execute(update(_VERSIONS).values(manifest_digest=digest[::-1]))


def tensors_total(connection: Connection) -> None:
    connection.execute(update(_VERSIONS).values(tensors_total=_VERSIONS.c.tensors_total + 1))


def tensors_new(connection: Connection) -> None:
    connection.execute(update(_VERSIONS).values(tensors_new=_VERSIONS.c.tensors_new - 1))


def parts_list(connection: Connection) -> None:
    parts = connection.execute(select(_VERSIONS.c.parts)).scalar_one()
    assert len(parts) > 1
    connection.execute(update(_VERSIONS).values(parts=parts[1:]))


def part_reference(connection: Connection) -> None:
    pid, _body = _body_holding(connection, f'"{KEY}"')
    digest = connection.execute(select(_REFS.c.digest).where(_REFS.c.part_id == pid).limit(1)).scalar_one()
    connection.execute(delete(_REFS).where(_REFS.c.part_id == pid, _REFS.c.digest == digest))


#: name -> (the change, what verify names, whether a load reads the changed bytes)
CHANGES: dict[str, tuple[Callable[[Connection], None], set[str], bool]] = {
    "part key": (part_key, {"part", "manifest"}, True),
    "part tensor digest": (part_tensor_digest, {"part", "manifest"}, True),
    "head step": (head_step, {"manifest", "step"}, True),
    "listed metric": (listed_metric, {"metrics"}, False),
    "manifest digest": (manifest_digest, {"manifest"}, True),
    "tensors_total": (tensors_total, {"tensors_total"}, False),
    "tensors_new": (tensors_new, {"tensors_new, bytes_new"}, False),
    "parts list": (parts_list, {"manifest", "tensors_total", "bytes_total", "bytes_trainable"}, True),
    "part reference": (part_reference, {"part"}, False),
}


def named(problems: object) -> set[str]:
    """What the problems of a verify report name: a part as ``part``, else the piece's name."""
    assert isinstance(problems, list)
    return {"part" if p["key"].startswith("part ") else p["key"] for p in problems}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_fails_verify_and_every_load_that_reads_it(saved: Saved, name: str) -> None:
    change, pieces, read_by_load = CHANGES[name]
    saved.change(change)

    status, report = saved.verify_json()
    assert status == 1 and report["ok"] is False
    assert named(report["problems"]) == pieces
    assert all((p["run_id"], p["version"]) == ("run", 1) for p in report["problems"])  # type: ignore[index, union-attr]
    assert all(p["problem"].startswith("stored metadata: ") for p in report["problems"])  # type: ignore[index, union-attr]

    if read_by_load:
        with pytest.raises(IntegrityError, match=r"^run 'run' version 1: its stored manifest does not match") as caught:
            saved.ckpt.load("run")
        assert "\n" not in str(caught.value)
    else:  # a load trusts the manifest alone, which is unchanged
        loaded = saved.ckpt.load("run")
        assert (loaded.step, loaded.metrics) == (202, {"loss": 0.25})
        assert loaded.state_dict is not None and loaded.state_dict.keys() == saved.state.keys()
        assert all(torch.equal(loaded.state_dict[k], v) for k, v in saved.state.items())


def test_an_unchanged_store_verifies_clean_and_a_table_names_what_changed(saved: Saved) -> None:
    status, report = saved.verify_json()
    assert (status, report["ok"], report["problems"], report["versions"]) == (0, True, [], 1)
    assert saved.ckpt.transport.check_metadata("run", 1) == []

    saved.change(head_step)
    done = ckptstore(saved.env, "verify", "run@1")
    assert done.returncode == 1
    lines = [line.split(None, 2) for line in done.stdout.splitlines() if line.startswith("run@1")]
    assert [(version, where) for version, where, _rest in lines] == [("run@1", "manifest"), ("run@1", "step")]
    assert "listed as 212, the manifest says 202" not in done.stdout  # the listing kept 202: the head changed
    assert "listed as 202, the manifest says 212" in done.stdout
    assert done.stderr.startswith("error: 2 problems found")


# -- a fuller manifest checks clean: chunked and empty tensors, state, every listed column ---------


def test_a_manifest_of_every_kind_of_entry_checks_clean(saved: Saved) -> None:
    store = saved.ckpt.transport
    assert isinstance(store, Store)
    _receipt, (whole, top, bottom) = store.put_tensors(
        [
            UnhashedTensor("F32", shape, memoryview(bytes(range(n))))
            for shape, n in (((2, 2), 16), ((1, 2), 8), ((1, 3), 12))
        ]
    )
    common = {"dtype": "F32", "dtype_class": "floating", "device_type": "cpu"}
    tensors = [
        TensorEntry(key="model/a", shape=[2, 2], digest=whole, placement="target", trainable=True, **common),
        TensorEntry(
            key="model/b",
            shape=[2, 2],
            chunks=[Chunk(offsets=[0, 0], shape=[1, 2], digest=top), Chunk(offsets=[1, 0], shape=[1, 2], digest=top)],
            placement="param",
            param="b",
            trainable=False,
            **common,
        ),
        TensorEntry(key="optim/c", shape=[1, 3], digest=bottom, placement="host", **common),
        TensorEntry(
            key="extra/empty",
            shape=[0, 3],
            digest=tensor_digest("F32", (0, 3), b""),
            placement="target",
            **common,
        ),
    ]
    body = ManifestBody(
        tensors=tensors,
        step=7,
        metrics={"loss": 1.0, "lr": 3e-4, "acc": 1 / 3, "big": 1e300},
        state={"extra": {"epoch": 2, "ids": [1, 2, 3], "w": {"__tensor__": "extra/empty"}}},
    )
    store.commit("full", body)
    store.commit("full", body)  # a parent, and parts shared with the first
    assert store.check_metadata("full", 1) == [] and store.check_metadata("full", 2) == []
    assert store.manifest("full", 2).tensors == tensors


# -- over a real server -----------------------------------------------------------------------------


def test_over_a_server_a_changed_manifest_is_a_400_integrity_answer_and_verify_names_it(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "server")
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings)) as url, client.Client(url) as ckpt:
            ckpt.save("run", layered_model(), step=202, metrics={"loss": 0.25})
            with store.db.engine.begin() as connection:
                part_key(connection)

            with pytest.raises(IntegrityError, match=r"^run 'run' version 1: its stored manifest does not match"):
                ckpt.load("run")
            answer = httpx.get(f"{url}/v1/runs/run/versions/1")
            assert answer.status_code == 400 and answer.headers["x-error-code"] == "integrity"
            assert answer.json()["message"].startswith("run 'run' version 1: ")
            checked = httpx.get(f"{url}/v1/runs/run/versions/latest/metadata-check")
            assert checked.status_code == 200
            assert {p["where"].split()[0] for p in checked.json()} == {"part", "manifest"}

            report = verify(ckpt.transport, [("run", "latest")])
            assert not report.ok and named([{"key": p.key} for p in report.problems]) == {"part", "manifest"}
            env = {**os.environ, "CKPTSTORE_URL": url, "CKPTSTORE_HOME": str(tmp_path / "unused")}
            env.pop("CKPTSTORE_TOKEN", None)
            done = ckptstore(env, "verify")
            assert done.returncode == 1 and "run@1" in done.stdout and "stored metadata" in done.stdout
    finally:
        store.close()


# -- one changed character anywhere in the head or a part body --------------------------------------

#: Characters a change writes: any but NUL (PostgreSQL's text holds none) and lone surrogates.
CHARACTERS = st.characters(min_codepoint=1, max_codepoint=0x2FF, exclude_categories=("Cs",))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_one_changed_character_in_the_head_or_a_part_body_is_always_caught(saved: Saved, data: st.DataObject) -> None:
    store = saved.ckpt.transport
    assert isinstance(store, Store)
    with saved.database.engine.connect() as connection:
        head = connection.execute(select(_VERSIONS.c.manifest)).scalar_one()
        bodies = dict(connection.execute(select(_BODIES.c.part_id, _BODIES.c.body)).all())
    target = data.draw(st.sampled_from([None, *sorted(bodies)]), label="part (None: the head)")
    original = head if target is None else bodies[target]
    at = data.draw(st.integers(0, len(original) - 1), label="position")
    character = data.draw(CHARACTERS.filter(lambda c: c != original[at]), label="character")
    changed = original[:at] + character + original[at + 1 :]
    if target is None:
        statement = update(_VERSIONS).values(manifest=changed)
        restore = update(_VERSIONS).values(manifest=original)
    else:
        statement = update(_BODIES).where(_BODIES.c.part_id == target).values(body=changed)
        restore = update(_BODIES).where(_BODIES.c.part_id == target).values(body=original)
    saved.change(lambda connection: connection.execute(statement))
    try:
        with pytest.raises(IntegrityError, match="run 'run' version 1"):
            store.manifest("run", 1)
        problems = store.check_metadata("run", 1)
        assert problems and {p.where for p in problems} & {"manifest", f"part {target}"}
    finally:
        saved.change(lambda connection: connection.execute(restore))
    assert store.check_metadata("run", 1) == []
