"""What writers killed mid-save leave in the staging folders is swept; what a live writer holds is not.

Every temporary file (``*.incomplete``) is held by its writer with a lock the kernel drops
when the writer dies (:mod:`service.blobs.held_file`), so ``ckptstore gc --orphans``, a
server's start and an embedded store's opening remove a killed writer's files at any age and
never a live one's. Here real saving processes are SIGKILLed at seeded points of their saves,
a paused save holds its file through a real ``ckptstore gc --orphans --grace 0``, and each place
that creates a staging file is caught mid-write by a sweep.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.client.api import Client
from ckptstore.client.connection import Connection
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api.app import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.blobs.held_file import hold_new
from ckptstore.service.format.records import GcReport
from ckptstore.service.format.safetensors_header import encode_header
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.intake.direct_file import DirectFileWriter
from ckptstore.service.intake.write_mode import measure
from ckptstore.service.store import Store
from tests.servers import running_server
from tests.service.shardkit import raw
from tests.stress.harness import PHASES, KillSwitch, Target
from tests.stress.model import StressNet
from tests.stress.procs import ROOT, STEP_TIMEOUT, Peer, child_env, start_victims

RUN = "run"
#: Small shards, so a save writes several staging files one after another.
SHARD_BYTES = 192 << 10
KILLS = 20
SEED = 20_261_207
#: Phases at which the victim holds a staging file: after a tensor is written into it, while
#: it is checked complete, just before it moves into the blob store.
STAGING_PHASES = ("tensor", "verify", "store-blob")


def leftovers(home: Path) -> list[Path]:
    """The temporary files in the store's staging folder and its blob store's ``.incoming``."""
    folders = (home / "staging", home / "blobs" / ".incoming")
    return sorted(path for folder in folders if folder.is_dir() for path in folder.glob("*.incomplete"))


def written_by_a_process_that_ended(path: Path, size: int) -> Path:
    """A staging file a writer left without removing it: written by a process that has exited."""
    code = f"open({str(path)!r}, 'wb').write(bytes({size}))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=STEP_TIMEOUT)
    return path


def ckptstore(home: Path, *args: str) -> str:
    """Run the real ``ckptstore`` command line on the embedded store in ``home``; its stdout."""
    env = child_env(home, home.parent)
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=STEP_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def victims(tmp_path: Path) -> Iterator[Peer]:
    """The fork server of saving processes (torch imported once), on the store in ``tmp_path/home``."""
    (tmp_path / "tmp").mkdir()
    peer = start_victims(child_env(tmp_path / "home", tmp_path / "tmp"), tmp_path / "victims.log")
    yield peer
    peer.stop()


def run_job(victims: Peer, home: Path, start: int, count: int) -> str:
    """Have a forked victim save steps ``start``.. of the model into ``home``; how it ended."""
    job = {"run": RUN, "seed": SEED, "start": start, "count": count, "wait": True, "shard_bytes": SHARD_BYTES}
    victims.send(json.dumps({**job, "home": str(home), "url": None}))
    while True:
        line = victims.next_line()
        assert line is not None, "the victim fork server died"
        if line.startswith("exit "):
            return line.split()[2]


def kill_child(victims: Peer) -> Callable[[], None]:
    """SIGKILL the victim's current child."""

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):  # a racing kill may find the save done
            os.kill(victims.child_pid, signal.SIGKILL)

    return kill


@pytest.mark.slow  # twenty saving processes killed, one after another
def test_gc_orphans_leaves_nothing_of_twenty_killed_saves(victims: Peer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    rng = random.Random(SEED)
    killed = exact_in_staging = 0
    job = 0
    while killed < KILLS:
        job += 1
        assert job <= 3 * KILLS, "the kill points keep missing the saves"
        last = killed == KILLS - 1
        if last or rng.random() < 0.5:  # a staging file is held at the moment of the kill
            phase, style = rng.choice(STAGING_PHASES), "exact"
        else:  # anywhere in the save, at the phase or just after it
            phase, style = rng.choice(sorted(PHASES["embedded"])), rng.choice(("exact", "racing"))
        target = Target(phase, rng.randint(1, 3 if last else PHASES["embedded"][phase]), style, 0.0)
        switch = KillSwitch(target, victims.send, kill_child(victims))
        victims.on_phase = switch
        before = set(leftovers(home))
        ended = run_job(victims, home, start=job, count=2)
        if not switch.fired or ended == "code:0":
            assert ended == "code:0", f"a save nobody killed ended with {ended}"
            continue
        assert ended == f"signal:{signal.SIGKILL.value}"
        killed += 1
        left = set(leftovers(home))
        # The killed save's opening swept what the kill before it left.
        assert not before & left, f"the next embedded open left {sorted(before & left)}"
        if style == "exact" and phase in STAGING_PHASES:
            exact_in_staging += 1
            assert left, f"killed at {phase} #{target.occurrence}, yet no staging file was left"
    assert exact_in_staging >= KILLS // 3
    found = leftovers(home)
    assert found  # the last kill's, held by nobody now

    report = json.loads(ckptstore(home, "gc", "--orphans", "--grace", "0", "--json"))

    assert leftovers(home) == [] and report["dry_run"] is False
    assert list((home / "staging").glob("*.incomplete")) == []
    assert list((home / "blobs" / ".incoming").iterdir()) == []
    with Client(home=home) as ckpt:  # what the killed saves committed loads whole
        for info in ckpt.versions(RUN):
            model = StressNet(SEED, info.step or 0)
            ckpt.load(RUN, info.version, model=model)
            expected = StressNet(SEED, info.step or 0).state_dict()
            assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


@pytest.mark.slow  # a saving process paused mid-save while the real command line collects
def test_gc_orphans_spares_a_live_saves_staging_file_and_that_save_commits(victims: Peer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    paused = threading.Event()
    resume: list[Callable[[], None]] = []

    def pause_at_first_tensor(phase: str) -> None:
        if phase == "tensor" and not paused.is_set():
            resume.append(lambda: victims.send("go"))
            paused.set()  # the staging file is written into, and held
            return
        victims.send("go")

    victims.on_phase = pause_at_first_tensor
    job = {"run": RUN, "seed": SEED, "start": 1, "count": 1, "wait": True, "shard_bytes": SHARD_BYTES}
    victims.send(json.dumps({**job, "home": str(home), "url": None}))
    assert paused.wait(STEP_TIMEOUT), "the save never wrote a tensor"
    # The paused writer's file, and maybe those of the save's other writers (they go on: their
    # files are moved into the blob store as they finish, so they may be gone after the sweep).
    live = leftovers(home)
    assert live and all(path.parent.name == "staging" for path in live)
    dead = written_by_a_process_that_ended(home / "staging" / f"{uuid.uuid4().hex}.incomplete", 4096)

    report = json.loads(ckptstore(home, "gc", "--orphans", "--grace", "0", "--json"))

    assert not dead.exists()
    assert any(path.exists() for path in live), "gc --orphans removed the staging file of a save in progress"
    assert report["shards_swept"] == 0
    victims.on_phase = lambda phase: victims.send("go")
    resume[0]()
    lines = []
    while not lines or not lines[-1].startswith("exit "):
        line = victims.next_line()
        assert line is not None, "the victim fork server died"
        lines.append(line)
    assert lines[-1].endswith(" code:0") and "done" in lines, lines
    saved = next(line for line in lines if line.startswith("saved "))
    assert leftovers(home) == []
    with Client(home=home) as ckpt:
        version = json.loads(saved[len("saved ") :])["version"]
        model = StressNet(SEED, 2)
        ckpt.load(RUN, version, model=model)
        expected = StressNet(SEED, 1).state_dict()
        assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


def test_opening_an_embedded_store_removes_a_leftover_nobody_holds(tmp_path: Path) -> None:
    home = tmp_path / "home"
    Store.open_home(home).close()
    dead = written_by_a_process_that_ended(home / "staging" / "killed.incomplete", 1000)
    held = hold_new(home / "staging" / "writing.incomplete")  # a live writer's, in this very process
    copy = written_by_a_process_that_ended(home / "blobs" / ".incoming" / "ab.cd.incomplete", 10)

    with Connection(home=home):
        assert not dead.exists() and not copy.exists()
        assert held.path.exists()
    held.remove()


def test_post_gc_with_orphans_reports_the_staging_files_it_removed(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    try:
        with running_server(create_app(store)) as url:
            dead = written_by_a_process_that_ended(store.staging_dir / "killed.incomplete", 1234)
            held = hold_new(store.staging_dir / "receiving.incomplete")
            transport = HttpTransport(url, None)
            try:
                dry = transport.gc(grace_seconds=0, dry_run=True, orphans=True)
                assert (dry.staging_files_swept, dry.staging_bytes_swept) == (1, 1234) and dead.exists()
                done = transport.gc(grace_seconds=0, orphans=True)
                plain = transport.gc(grace_seconds=0)
            finally:
                transport.close()
        assert (done.staging_files_swept, done.staging_bytes_swept) == (1, 1234)
        assert (plain.staging_files_swept, plain.staging_bytes_swept) == (0, 0)
        assert not dead.exists() and held.path.exists()
        held.remove()
    finally:
        store.close()


# -- each place a staging file is made, caught mid-write by gc --orphans ------------------------

TENSORS = [raw("F32", (64, 1024), seed) for seed in range(3)]


def unhashed_body() -> bytes:
    """An upload of :data:`TENSORS` unhashed: the layout's length, the layout, the raw bytes."""
    layout = json.dumps([[t.dtype, list(t.shape)] for t in TENSORS]).encode()
    return struct.pack("<Q", len(layout)) + layout + b"".join(t.data for t in TENSORS)


def shard_parts() -> tuple[bytes, list[memoryview]]:
    """:data:`TENSORS` as a shard: its header and its tensors' bytes in header order."""
    header, entries = encode_header([(t.digest, t.dtype, t.shape) for t in TENSORS])
    by_digest = {t.digest: t for t in TENSORS}
    return header, [memoryview(by_digest[e.digest].data) for e in entries]


def save_shard(store: Store) -> Any:
    header, pieces = shard_parts()
    return store.put_shard(header, pieces)


def save_tensors(store: Store) -> Any:
    return store.put_tensors([UnhashedTensor(t.dtype, t.shape, memoryview(t.data)) for t in TENSORS])


def receive_upload(store: Store) -> Any:
    header, pieces = shard_parts()
    receiver = store.receiver()
    receiver.write(header)
    for piece in pieces:
        receiver.write(piece)
    return store.ingest_received(receiver)


def receive_unhashed_upload(store: Store) -> Any:
    body = unhashed_body()
    receiver = store.intake.unhashed_receiver(length=len(body), max_bytes=len(body))
    receiver.write(body)
    return store.intake.store_unhashed(receiver)


def ingest_a_written_file(store: Store) -> Any:
    header, pieces = shard_parts()
    path = store.staging_path()
    path.write_bytes(header + b"".join(pieces))
    return store.ingest_file(path)


#: Each way a shard reaches a staging file; each ends by moving it into the blob store.
MOVED_IN = {
    "embedded save (receiver)": save_shard,
    "unhashed save (shard writer)": save_tensors,
    "upload (receiver)": receive_upload,
    "unhashed upload": receive_unhashed_upload,
    "a caller's file (staging_path)": ingest_a_written_file,
}


def sweep_during(store: Store, seen: list[tuple[GcReport, list[Path]]]) -> Callable[..., Any]:
    """A wrapper that collects with ``orphans`` (grace 0) before the wrapped call, noting the
    report and the temporary files there just before."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        def swept_first(*args: Any, **kwargs: Any) -> Any:
            if not seen:
                present = leftovers(store.staging_dir.parent)
                seen.append((store.gc(grace_seconds=0, orphans=True), present))
            return function(*args, **kwargs)

        return swept_first

    return wrap


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open_home(tmp_path / "home", direct_writes=False)
    yield opened
    opened.close()


@pytest.mark.parametrize("way", sorted(MOVED_IN))
def test_a_staging_file_being_moved_in_survives_gc_orphans_beside_a_dead_ones(
    way: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = written_by_a_process_that_ended(store.staging_dir / "killed.incomplete", 100)
    seen: list[tuple[GcReport, list[Path]]] = []
    monkeypatch.setattr(LocalBlobStore, "put_file", sweep_during(store, seen)(LocalBlobStore.put_file))

    receipt = MOVED_IN[way](store)

    report, present = seen[0]
    assert len(present) == 2 and dead in present  # the dead one and the one being moved in
    assert (report.staging_files_swept, report.staging_bytes_swept) == (1, 100)
    assert not dead.exists()
    shard = receipt[0] if isinstance(receipt, tuple) else receipt
    assert shard.created and store.blobs.size(shard.shard_id) == shard.size
    assert leftovers(store.staging_dir.parent) == []


def test_a_copy_into_incoming_survives_gc_orphans(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = Path("/dev/shm")
    if not elsewhere.is_dir() or os.stat(elsewhere).st_dev == os.stat(store.staging_dir).st_dev:
        pytest.skip("needs a second file system for the staging file (/dev/shm)")
    header, pieces = shard_parts()
    source = elsewhere / f"ckptstore-{uuid.uuid4().hex}.incomplete"
    source.write_bytes(header + b"".join(pieces))
    dead = written_by_a_process_that_ended(store.blobs.root / ".incoming" / "ab.cd.incomplete", 7)
    seen: list[tuple[GcReport, list[Path]]] = []
    monkeypatch.setattr(shutil, "copyfileobj", sweep_during(store, seen)(shutil.copyfileobj))
    try:
        receipt = store.ingest_file(source)
    finally:
        source.unlink(missing_ok=True)

    report, present = seen[0]
    assert len(present) == 2 and dead in present and {path.parent.name for path in present} == {".incoming"}
    assert (report.staging_files_swept, report.staging_bytes_swept) == (1, 7)
    assert store.blobs.size(receipt.shard_id) == receipt.size
    assert leftovers(store.staging_dir.parent) == []


def test_the_write_mode_probe_survives_gc_orphans(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = written_by_a_process_that_ended(store.staging_dir / "killed.incomplete", 3)
    seen: list[tuple[GcReport, list[Path]]] = []
    monkeypatch.setattr(DirectFileWriter, "close", sweep_during(store, seen)(DirectFileWriter.close))

    choice = measure(store.staging_dir)

    report, present = seen[0]
    assert len(present) == 2 and any(path.name.startswith("probe-") for path in present)
    assert report.staging_files_swept == 1 and not dead.exists()
    assert choice.buffered_seconds is not None
    assert leftovers(store.staging_dir.parent) == []
