"""The cyclic garbage collector is off while a save or load runs, and comes back as it was."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import client
from ckptstore.client.cyclic_gc import paused_collection


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_nested_pauses_switch_the_collector_back_on_at_the_last_exit() -> None:
    with paused_collection():
        assert not gc.isenabled()
        with paused_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_program_running_without_the_collector_keeps_it_off() -> None:
    gc.disable()
    with paused_collection():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_still_switches_it_back_on() -> None:
    with pytest.raises(RuntimeError), paused_collection():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads() -> None:
    """The first thread to leave must not switch the collector on while the other is inside."""
    inside, leave = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with paused_collection():
            inside.set()
            leave.wait(timeout=30)
            seen.append(gc.isenabled())

    thread = threading.Thread(target=other)
    with paused_collection():
        thread.start()
        assert inside.wait(timeout=30)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    thread.join(timeout=30)
    assert seen == [False]
    assert gc.isenabled()


class Probe(torch.nn.Module):
    """A model whose state_dict records whether the collector was on when a save or load read it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.collector_on: list[bool] = []

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.collector_on.append(gc.isenabled())
        return super().state_dict(*args, **kwargs)


def test_save_and_load_run_with_the_collector_paused_and_restore_it(tmp_path: Path) -> None:
    model = Probe()
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        ckpt.load("run", model=model)
        with pytest.raises(client.StateMismatchError):
            ckpt.load("run", model=torch.nn.Linear(2, 2))
    assert model.collector_on and not any(model.collector_on)
    assert gc.isenabled()
