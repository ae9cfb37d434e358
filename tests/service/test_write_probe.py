"""The store picks direct or buffered writes by measuring its staging disk once, then keeps the choice."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import types
from pathlib import Path
from typing import Any

import pytest

from ckptstore.service.intake import write_mode as write_probe
from ckptstore.service.intake.write_mode import CACHE_NAME, LOCK_NAME, WriteChoice, choose_direct_writes, measure
from ckptstore.service.store import Store


def test_the_probe_measures_both_ways_and_the_cheaper_wins(tmp_path: Path) -> None:
    choice = measure(tmp_path)
    assert choice.buffered_seconds > 0 and choice.buffered_cpu_seconds is not None
    if choice.direct_seconds is None:  # a file system refusing O_DIRECT: buffered without a contest
        assert choice.direct is False
    else:
        assert choice.direct_cpu_seconds is not None
        direct = WriteChoice.cost(choice.direct_seconds, choice.direct_cpu_seconds)
        buffered = WriteChoice.cost(choice.buffered_seconds, choice.buffered_cpu_seconds)
        assert choice.direct == (direct <= buffered)
    assert choice.device == os.stat(tmp_path).st_dev
    assert list(tmp_path.iterdir()) == []  # no probe file left behind


def test_the_choice_is_cached_and_read_back_without_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = choose_direct_writes(tmp_path)
    cached = json.loads((tmp_path / CACHE_NAME).read_text())
    assert cached["direct"] == first.direct and cached["device"] == first.device

    def refuse(_: Path) -> WriteChoice:
        raise AssertionError("measured again although a cached choice exists")

    monkeypatch.setattr(write_probe, "measure", refuse)
    assert choose_direct_writes(tmp_path) == first
    # The cache says which way wins, and that is what a store there uses.
    flipped = {**cached, "direct": not cached["direct"]}
    (tmp_path / CACHE_NAME).write_text(json.dumps(flipped))
    assert choose_direct_writes(tmp_path).direct is (not first.direct)


WITHOUT_CPU = '{"direct": false, "direct_seconds": 0.03, "buffered_seconds": 0.02, "device": %d}'


def test_a_cost_counts_the_cpu_a_way_takes() -> None:
    # Buffered writes that finish sooner but copy every byte lose to direct ones that copy none.
    assert WriteChoice.cost(0.027, 0.007) < WriteChoice.cost(0.021, 0.016)
    assert WriteChoice.cost(0.040, 0.007) > WriteChoice.cost(0.021, 0.016)


def test_a_cache_chosen_by_time_alone_is_measured_again(tmp_path: Path) -> None:
    (tmp_path / CACHE_NAME).write_text(WITHOUT_CPU % os.stat(tmp_path).st_dev)
    choice = choose_direct_writes(tmp_path)
    assert choice.direct_cpu_seconds is not None or choice.direct_seconds is None
    assert json.loads((tmp_path / CACHE_NAME).read_text())["buffered_cpu_seconds"] is not None


@pytest.mark.parametrize("cache", ["not json", '{"direct": true}', "[]", '{"direct": true, "direct_seconds": 1}'])
def test_a_broken_cache_or_one_from_another_disk_is_measured_again(tmp_path: Path, cache: str) -> None:
    (tmp_path / CACHE_NAME).write_text(cache)
    choice = choose_direct_writes(tmp_path)
    assert json.loads((tmp_path / CACHE_NAME).read_text())["device"] == choice.device
    other = {**json.loads((tmp_path / CACHE_NAME).read_text()), "device": choice.device + 1, "direct": True}
    (tmp_path / CACHE_NAME).write_text(json.dumps(other))
    assert choose_direct_writes(tmp_path).device == choice.device


def test_a_store_measures_only_when_the_setting_is_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSTORE_DIRECT_WRITES", "0")
    store = Store.open_home(tmp_path / "set")
    try:
        assert store.direct_writes is False
        assert not (store.staging_dir / CACHE_NAME).exists()
    finally:
        store.close()
    monkeypatch.delenv("CKPTSTORE_DIRECT_WRITES")
    store = Store.open_home(tmp_path / "measured")
    try:
        assert not (store.staging_dir / CACHE_NAME).exists()  # opening a store measures nothing...
        store.prepare_writes()  # ...until a client that saves opens it, or the first shard comes
        chosen = store.direct_writes
        cached = json.loads((store.staging_dir / CACHE_NAME).read_text())
        assert chosen is cached["direct"]
        assert store.receiver().direct_writes is chosen
    finally:
        store.close()


def test_a_client_that_saves_settles_the_write_mode_on_opening(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore import client

    monkeypatch.delenv("CKPTSTORE_DIRECT_WRITES", raising=False)
    with client.Connection(home=tmp_path / "browse"):
        pass
    assert not (tmp_path / "browse" / "staging" / CACHE_NAME).exists()  # browsing measures nothing
    with client.Client(home=tmp_path / "save") as ckpt:
        assert (tmp_path / "save" / "staging" / CACHE_NAME).exists()
        assert (
            ckpt.transport.direct_writes
            is json.loads((tmp_path / "save" / "staging" / CACHE_NAME).read_text())["direct"]
        )  # type: ignore[attr-defined]


def test_a_disk_that_fails_the_measurement_gets_direct_writes_uncached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(_: Path) -> WriteChoice:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write_probe, "measure", full)
    assert choose_direct_writes(tmp_path).direct is True
    assert not (tmp_path / CACHE_NAME).exists()  # measured again once the disk has room


def _choose_in_child(folder: Path, log: Any, go: Any, role: str) -> None:
    """Run choose_direct_writes in a process of its own, telling ``log`` when it takes the lock and
    when it measures; its measurement waits for ``go`` and chooses direct writes only for "first"."""
    real_flock = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        log.put(f"{role} locks")
        real_flock(fd, operation)

    def measure(path: Path) -> WriteChoice:
        log.put(f"{role} measures")
        go.wait()
        return WriteChoice(role == "first", 1.0, 2.0, os.stat(path).st_dev, 0.1, 0.2)

    write_probe.fcntl = types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX)  # type: ignore[assignment]
    write_probe.measure = measure  # type: ignore[assignment]
    log.put(f"{role} chose {'direct' if choose_direct_writes(folder).direct else 'buffered'}")


def test_processes_starting_together_measure_once(tmp_path: Path) -> None:
    """A server's workers start at once: the second waits for the first's figures instead of
    measuring beside it."""
    context = multiprocessing.get_context("spawn")
    log, go = context.Queue(), context.Event()
    first = context.Process(target=_choose_in_child, args=(tmp_path, log, go, "first"), daemon=True)
    second = context.Process(target=_choose_in_child, args=(tmp_path, log, go, "second"), daemon=True)
    try:
        first.start()
        assert [log.get(timeout=60), log.get(timeout=60)] == ["first locks", "first measures"]
        second.start()
        assert log.get(timeout=60) == "second locks"  # and waits there, the first still measuring
        go.set()
        rest = sorted([log.get(timeout=60), log.get(timeout=60)])
    finally:
        go.set()
        for process in (first, second):
            if process.pid is not None:
                process.join(60)
                process.kill()
    assert rest == ["first chose direct", "second chose direct"]  # the second read the first's choice
    assert (first.exitcode, second.exitcode) == (0, 0)
    assert not (tmp_path / LOCK_NAME).exists()
    assert json.loads((tmp_path / CACHE_NAME).read_text())["direct"] is True
