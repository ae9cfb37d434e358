"""``background="auto"``, the default: background saves start on the client's thread and move to a
save process once they come often (a server's client too: the helper saves through the server);
a save process that cannot start is given up with a warning and the saves go on, on the thread,
losing nothing."""

from __future__ import annotations

import itertools
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.client import SaveHandle
from ckptstore.client.saving import cadence, save_process
from ckptstore.client.saving.cadence import SaveCadence, background_mode
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import READ_TOKEN, TOKENS, WRITE_TOKEN
from tests.client.models import TinyNet, loaded_tiny, same_state, state_copy, train, trained_tiny
from tests.servers import running_server


class _Clock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@given(gaps=st.lists(st.floats(min_value=0.0, max_value=3 * cadence.CLOSE_SECONDS), max_size=40))
def test_a_process_is_wanted_from_the_run_length_th_close_save_in_a_row(gaps: list[float]) -> None:
    clock = _Clock()
    saves = SaveCadence(clock)
    times, answers = [clock.now], [saves.often()]
    for gap in gaps:
        clock.now += gap
        times.append(clock.now)
        answers.append(saves.often())
    run, expected = 1, [cadence.RUN_LENGTH <= 1]
    for before, now in itertools.pairwise(times):  # the rule, written out: the run of close saves ending here
        run = run + 1 if now - before <= cadence.CLOSE_SECONDS else 1
        expected.append(run >= cadence.RUN_LENGTH)
    assert answers == expected
    assert answers[: cadence.RUN_LENGTH - 1] == [False] * min(len(answers), cadence.RUN_LENGTH - 1)


@given(
    value=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20) | st.sampled_from(cadence.MODES)
)
def test_the_mode_comes_from_the_argument_else_the_variable_else_auto(value: str) -> None:
    for mode in cadence.MODES:
        assert background_mode(mode) == mode
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(cadence.VARIABLE, raising=False)
        assert background_mode(None) == "auto"
        patch.setenv(cadence.VARIABLE, value)
        wanted = value.strip().lower() or "auto"
        if wanted in cadence.MODES:
            assert background_mode(None) == wanted
            assert background_mode("thread") == "thread"  # the argument wins
        else:
            with pytest.raises(client.InvalidInputError, match=r"\$CKPTSTORE_BACKGROUND must be"):
                background_mode(None)
    if value not in cadence.MODES:
        with pytest.raises(client.InvalidInputError, match="background must be"):
            background_mode(value)


def _save_often(
    ckpt: client.Client, model: TinyNet, optim: torch.optim.Optimizer, saves: int, done: int = 0
) -> list[dict]:
    """``saves`` background saves after ``done`` earlier ones, a training step after each call;
    the state each one holds."""
    expected = []
    for step in range(done, done + saves):
        expected.append(state_copy(model, optim))
        handle = ckpt.save("run", model, optim, step=step, blocking=False)
        train(model, optim, range(step + 2, step + 3))  # at once: the version holds the state before
        assert isinstance(handle, SaveHandle) and handle.result().version == step + 1
    return expected


@pytest.fixture
def trained() -> tuple[TinyNet, torch.optim.Optimizer]:
    return trained_tiny()


def test_saves_that_come_often_move_to_a_save_process(
    tmp_path: Path, trained: tuple[TinyNet, torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    model, optim = trained
    with client.Client(home=tmp_path) as ckpt:
        background = ckpt._background
        expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH - 1)
        assert background.process is None and background._starting is None  # the thread saved them
        expected += _save_often(ckpt, model, optim, 1, len(expected))
        process = background._starting  # started by that save, which ran on the thread meanwhile
        assert background.process is None and process is not None and not process.answered
        assert process.started.wait(120) and process.start_error is None
        expected += _save_often(ckpt, model, optim, 2, len(expected))
        assert background.process is process and process.pid is not None and process.answered
        # The thread's staging buffers went with the thread's saves: only the shared files are held.
        assert [slot.staging.nbytes for slot in background._slots] == [0] * len(background._slots)
        assert background.nbytes == sum(slot.shared.nbytes for slot in background._slots if slot.shared) > 0
        for version, state in enumerate(expected, start=1):
            assert same_state(loaded_tiny(ckpt, version), state)
    assert process.pid is None  # closing the client ends it


@pytest.mark.parametrize("how", ["variable", "argument", "saves far apart"])
def test_saves_stay_on_the_thread(
    how: str, tmp_path: Path, trained: tuple[TinyNet, torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    background = None
    if how == "variable":
        monkeypatch.setenv(cadence.VARIABLE, "thread")
    elif how == "argument":
        background = "thread"
    else:
        monkeypatch.setattr(cadence, "CLOSE_SECONDS", -1.0)  # no two saves are this close
    model, optim = trained
    with client.Client(home=tmp_path, background=background) as ckpt:  # type: ignore[arg-type]
        expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH + 2)
        assert ckpt._background.process is None
        assert same_state(loaded_tiny(ckpt, len(expected)), expected[-1])


@pytest.fixture
def server_url(tmp_path: Path) -> Iterator[str]:
    """A server whose writes need a token (:data:`WRITE_TOKEN`)."""
    store = Store.open_home(tmp_path / "server")
    try:
        with running_server(create_app(store, Settings(home=tmp_path / "server", tokens=TOKENS))) as url:
            yield url
    finally:
        store.close()


def test_a_servers_client_moves_to_a_save_process_that_saves_through_the_server(
    server_url: str, trained: tuple[TinyNet, torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper opens the same server with the client's token (sent over its input: neither
    its arguments nor its environment hold it) and saves there what the thread would have."""
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    model, optim = trained
    with client.Client(server_url, token=WRITE_TOKEN) as ckpt:
        background = ckpt._background
        expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH)
        process = background._starting
        assert process is not None and process.pid is not None
        command = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        environment = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert WRITE_TOKEN.encode() not in command + environment
        assert process.started.wait(120) and process.start_error is None
        expected += _save_often(ckpt, model, optim, 2, len(expected))
        assert background.process is process and process.answered
        for version, state in enumerate(expected, start=1):
            assert same_state(loaded_tiny(ckpt, version), state)
    with client.Client(server_url, token=READ_TOKEN, background="process") as reader:
        denied = reader.save("run", model, optim, blocking=False)
        assert isinstance(denied, SaveHandle)
        with pytest.raises(client.CheckpointError, match="write"):
            denied.result()
        assert [v.version for v in reader.versions("run")] == list(range(1, len(expected) + 1))


@pytest.mark.parametrize("executable", ["/nonexistent/python", "/bin/false"])
def test_a_save_process_that_cannot_start_is_given_up_and_no_save_is_lost(
    executable: str,
    tmp_path: Path,
    trained: tuple[TinyNet, torch.optim.Optimizer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The helper cannot be run (no such program), or ends at once without saying it is ready:
    the saves go on on the thread, the next save warns once, and the client stops trying."""
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    monkeypatch.setattr(sys, "executable", executable)
    model, optim = trained
    with client.Client(home=tmp_path) as ckpt:
        expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH)  # the last starts the process
        starting = ckpt._background._starting
        assert starting is not None and starting.started.wait(120)
        assert isinstance(starting.start_error, (OSError, client.StorageError))
        with pytest.warns(RuntimeWarning, match="the save process did not start") as caught:
            expected += _save_often(ckpt, model, optim, 1, len(expected))
        assert [w.filename for w in caught] == [__file__]  # the warning names the line that saved
        assert ckpt._background.process is None and ckpt._background._starting is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # given up once: no more tries, no more warnings
            expected += _save_often(ckpt, model, optim, cadence.RUN_LENGTH + 1, len(expected))
        assert ckpt._background.process is None and ckpt._background._starting is None
        assert [v.version for v in ckpt.versions("run")] == list(range(1, len(expected) + 1))
        for version, state in enumerate(expected, start=1):
            assert same_state(loaded_tiny(ckpt, version), state)


def test_a_platform_that_cannot_start_the_save_process_leaves_the_saves_on_the_thread(
    tmp_path: Path, trained: tuple[TinyNet, torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the helper cannot be started the way it is (``subprocess`` refuses ``pass_fds`` on
    Windows, with an AssertionError), that is a start that failed: a warning, the saves on the
    thread, none lost, and no save raising it."""
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    real = save_process.subprocess.Popen

    def popen(args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pass_fds"):
            raise AssertionError("pass_fds not supported on Windows.")  # as subprocess words it
        return real(args, **kwargs)

    monkeypatch.setattr(save_process.subprocess, "Popen", popen)
    model, optim = trained
    with client.Client(home=tmp_path) as ckpt:
        expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH)
        starting = ckpt._background._starting
        assert starting is not None and starting.started.wait(120)
        assert isinstance(starting.start_error, AssertionError)
        with pytest.warns(RuntimeWarning, match="pass_fds"):
            expected += _save_often(ckpt, model, optim, 2, len(expected))
        assert ckpt._background.process is None
        for version, state in enumerate(expected, start=1):
            assert same_state(loaded_tiny(ckpt, version), state)


def test_closing_a_client_ends_a_save_process_that_hangs_before_it_is_ready(
    tmp_path: Path, trained: tuple[TinyNet, torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper that never opens the store (here a program that only waits) holds its start: the
    client's close kills it rather than waiting for it, and the saves were made on the thread."""
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 3600\n")
    hang.chmod(0o755)
    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    monkeypatch.setattr(sys, "executable", str(hang))
    model, optim = trained
    ckpt = client.Client(home=tmp_path / "store")
    expected = _save_often(ckpt, model, optim, cadence.RUN_LENGTH + 2)
    starting = ckpt._background._starting
    assert starting is not None and starting.pid is not None and not starting.started.is_set()
    closing = threading.Thread(target=ckpt.close)
    closing.start()
    closing.join(60)
    assert not closing.is_alive() and starting.pid is None
    assert starting.started.is_set() and isinstance(starting.start_error, client.StorageError)
    with client.Client(home=tmp_path / "store", background="thread") as reader:
        assert same_state(loaded_tiny(reader, len(expected)), expected[-1])
