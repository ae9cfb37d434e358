"""A small background save snapshots while the save before it still runs, into a second set of
staging buffers: the call returns at once, the versions stay in order and hold the state as it
was when each call returned, an error still reaches the caller, and a large state waits."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.client import SaveHandle
from ckptstore.client.saving import background
from ckptstore.service.errors import StorageError
from tests.client.models import TinyNet, same_state, state_copy, train, trained_tiny


def _loads_as(ckpt: client.Client, version: int, expected: dict[str, torch.Tensor]) -> bool:
    model = TinyNet(seed=7)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load("run", version, model=model, optim=optim)
    return same_state(state_copy(model, optim), expected)


@contextmanager
def _commits_held(
    ckpt: client.Client, monkeypatch: pytest.MonkeyPatch, fail: bool = False
) -> Iterator[threading.Event]:
    """The next commit waits until the yielded event is set (then fails, with ``fail``)."""
    transport: Any = ckpt.transport
    real = transport.commit
    release = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(transport, "commit", real)
        release.wait()
        if fail:
            raise StorageError("storage is unavailable; retry shortly")
        return real(*args, **kwargs)

    monkeypatch.setattr(transport, "commit", held)
    try:
        yield release
    finally:
        release.set()


def test_a_save_returns_while_the_one_before_commits_and_both_hold_their_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = trained_tiny()
    with client.Client(home=tmp_path) as ckpt:
        with _commits_held(ckpt, monkeypatch) as release:
            first_state = state_copy(model, optim)
            first = ckpt.save("run", model, optim, blocking=False)
            train(model, optim, range(2, 3))
            second_state = state_copy(model, optim)
            second = ckpt.save("run", model, optim, blocking=False)  # returns: the first is held
            assert isinstance(first, SaveHandle) and isinstance(second, SaveHandle)
            assert not first.done() and not second.done()
            train(model, optim, range(3, 4))  # at once: neither version sees it
            release.set()
            assert (first.result().version, second.result().version) == (1, 2)
        assert _loads_as(ckpt, 1, first_state) and _loads_as(ckpt, 2, second_state)


def test_a_third_save_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optim = trained_tiny()
    with client.Client(home=tmp_path) as ckpt:
        with _commits_held(ckpt, monkeypatch) as release:
            first = ckpt.save("run", model, optim, blocking=False)
            second = ckpt.save("run", model, optim, blocking=False)
            threading.Timer(0.05, release.set).start()  # the third call can only return after this
            third = ckpt.save("run", model, optim, blocking=False)
            assert release.is_set() and first.done()
        assert [h.result().version for h in (first, second, third)] == [1, 2, 3]


def test_an_error_reaches_the_caller_from_a_later_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optim = trained_tiny()
    with client.Client(home=tmp_path) as ckpt:
        with _commits_held(ckpt, monkeypatch, fail=True) as release:
            failed = ckpt.save("run", model, optim, blocking=False)
            queued = ckpt.save("run", model, optim, blocking=False)
            release.set()
            assert isinstance(queued, SaveHandle) and queued.result().version == 1
        with pytest.raises(StorageError):
            ckpt.save("run", model, optim, blocking=False)  # the first's error, nobody collected it
        with pytest.raises(StorageError):
            failed.result()  # still there for whoever holds the handle
        assert ckpt.save("run", model, optim, blocking=False).result().version == 2


def test_a_large_snapshot_waits_for_the_save_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "OVERLAP_BYTES", 0)
    model, optim = trained_tiny()
    with client.Client(home=tmp_path) as ckpt:
        first = ckpt.save("run", model, optim, blocking=False)
        second = ckpt.save("run", model, optim, blocking=False)
        assert first.done()  # the second call waited for it
        staged = second.staged_bytes
        second.result()
        assert ckpt._background.nbytes <= staged + 64 * 64  # one set of buffers


def test_a_save_process_takes_the_next_snapshot_while_it_is_stopped(tmp_path: Path) -> None:
    """The helper is stopped (SIGSTOP) mid-way: the next save still returns, its snapshot in a
    second shared file; once the helper runs again both versions hold their state."""
    model, optim = trained_tiny()
    with client.Client(home=tmp_path, background="process") as ckpt:
        ckpt.save("run", model, optim, blocking=False).result()  # starts the helper
        process = ckpt._background.process
        assert process is not None and process.pid is not None
        pid = process.pid
        expected = []
        os.kill(pid, signal.SIGSTOP)
        try:
            handles = []
            for step in range(2):
                train(model, optim, range(2 + step, 3 + step))
                expected.append(state_copy(model, optim))
                handles.append(ckpt.save("run", model, optim, blocking=False))
            assert not any(h.done() for h in handles)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [h.result().version for h in handles] == [2, 3]
        assert _loads_as(ckpt, 2, expected[0]) and _loads_as(ckpt, 3, expected[1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["step", "save", "save", "blocking save", "result", "held"]), min_size=1, max_size=12))
def test_any_mix_of_steps_saves_and_waits_keeps_every_version_as_it_was(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, actions: list[str]
) -> None:
    """Whatever the caller does between saves (steps, blocking saves, waiting on an older
    handle, a commit held while the next saves are taken), version n holds the state as it was
    when the n-th save call returned."""
    model, optim = trained_tiny()
    expected: list[dict[str, torch.Tensor]] = []
    handles: list[SaveHandle] = []
    releases: list[threading.Event] = []
    step, held_from = 2, 0
    with client.Client(home=tmp_path_factory.mktemp("store")) as ckpt, monkeypatch.context() as patch:
        for action in actions:
            if action == "step":
                train(model, optim, range(step, step + 1))
                step += 1
            elif action == "result" and handles:
                waited = len(handles) // 2
                if releases and waited >= held_from:  # it would wait for the held commit
                    releases.pop().set()
                handles[waited].result()
            elif action == "held" and not releases:  # the next commit waits until released
                releases.append(_commits_held(ckpt, patch).__enter__())
                held_from = len(handles)
            elif action in ("save", "blocking save"):
                blocking = action == "blocking save"
                # A blocking save waits for the held commit, and so does the second background
                # save after the held one: let it go first.
                if releases and (blocking or len(handles) - held_from >= 2):
                    releases.pop().set()
                expected.append(state_copy(model, optim))
                outcome = ckpt.save("run", model, optim, blocking=blocking)
                if isinstance(outcome, SaveHandle):
                    handles.append(outcome)
                else:
                    assert outcome.version == len(expected)
        for release in releases:
            release.set()
        for handle in handles:
            handle.result()
        if not expected:
            assert ckpt.runs() == []
            return
        assert [v.version for v in ckpt.versions("run")] == list(range(1, len(expected) + 1))
        for version, state in enumerate(expected, start=1):
            assert _loads_as(ckpt, version, state), version
