"""A compressing collection's bar has a total: the raw bytes the pass will visit, counted before
it starts (each tensor once, however many runs hold it), so it shows how far it is and the time
left; off when stderr is not a terminal, or by ``CKPTSTORE_DISABLE_PROGRESS_BARS``."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from compression_kit import FineTune

import ckptstore.client.progress  # noqa: F401  (binds client.progress for the names below)
from ckptstore import client
from ckptstore.service.store import Store


class Told:
    """What a collection told its ``on_bytes``: the total first, then each tensor's bytes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, nbytes: int) -> None:
        self.events.append(("bytes", nbytes))

    def expect(self, total: int) -> None:
        self.events.append(("total", total))


def _two_runs(ckpt: client.Client) -> None:
    tune = FineTune(torch.bfloat16)
    for _ in range(2):
        tune.save(ckpt, "first")
        ckpt.save("fork", tune.model, tune.optim)  # the same tensors in a second run


def test_the_total_comes_first_and_is_what_the_pass_visits(store: Store, ckpt: client.Client) -> None:
    _two_runs(ckpt)
    told = Told()

    report = store.gc(compress=True, grace_seconds=0, on_bytes=told)

    (first, total), *rest = told.events
    assert first == "total" and all(kind == "bytes" for kind, _ in rest)
    visited = sum(nbytes for _, nbytes in rest)
    assert total == visited == report.bytes_before_compression > 0
    again = Told()
    store.gc(compress=True, grace_seconds=0, on_bytes=again)
    assert again.events == [("total", 0)]  # every version visited: nothing left to count


def test_the_bar_shows_a_total_and_the_time_left_only_on_a_terminal(
    store: Store, ckpt: client.Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_runs(ckpt)
    capsys.readouterr()
    ckpt.gc(compress=True, grace_seconds=0, dry_run=True)
    assert "compress" not in capsys.readouterr().err  # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("CKPTSTORE_DISABLE_PROGRESS_BARS", "1")
    assert not client.progress.bars_enabled()
    monkeypatch.delenv("CKPTSTORE_DISABLE_PROGRESS_BARS")
    assert client.progress.bars_enabled()

    assert ckpt.gc(compress=True, grace_seconds=0).versions_compressed == 4

    shown = capsys.readouterr().err
    # A share of a total, the bytes out of it, and the time left ("elapsed<left"); without a
    # total tqdm shows only "compress: 0.00B [00:00, ?B/s]".
    assert re.search(r"compress:\s+\d+%\|[^\r]*\d/\d[.\d]*[kMG]? \[\d\d:\d\d<", shown), shown
