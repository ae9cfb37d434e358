"""Background saves: the version holds the state as it was when save() returned, whatever the
caller did next; errors reach the caller; versions stay in order; nothing partial is left."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.client.saving.snapshot import SaveHandle
from ckptstore.service.errors import StorageError
from tests.client.conftest import Backend
from tests.client.models import Adapter, TinyNet, tensors_equal, train
from tests.faults.faulty import fail_staging_writes


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every model tensor and optimizer state tensor, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for param, values in optim.state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"optim/{names[id(param)]}/{key}"] = value.clone()
    return state


def _assert_loads_as(ckpt: client.Client, run: str, version: int, expected: dict[str, torch.Tensor]) -> None:
    model = TinyNet(seed=7)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(run, version, model=model, optim=optim)
    loaded = _state(model, optim)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert tensors_equal(loaded[key], value), f"{key} is not as it was when save() returned"


def test_a_background_save_holds_the_state_as_it_was_when_save_returned(backend: Backend) -> None:
    ckpt = backend.client
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    expected = [_state(model, optim)]
    handles = [ckpt.save("bg", model, optim, blocking=False)]
    train(model, optim, range(2, 3))  # at once: weights and moments change in place
    expected.append(_state(model, optim))
    handles.append(ckpt.save("bg", model, optim, blocking=False))
    train(model, optim, range(3, 4))
    assert all(isinstance(h, SaveHandle) for h in handles)
    results = [h.result() for h in handles]
    assert [r.version for r in results] == [1, 2]
    assert all(h.done() for h in handles)
    for result, state in zip(results, expected, strict=True):
        _assert_loads_as(ckpt, "bg", result.version, state)
    assert not tensors_equal(_state(model, optim)["model/body.0.weight"], expected[1]["model/body.0.weight"])


def test_staging_holds_only_what_the_cache_does_not_know(backend: Backend) -> None:
    ckpt = backend.client
    model = Adapter()
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    model.head(torch.randn(2, 256)).sum().backward()
    optim.step()
    first = ckpt.save("adapter", model, optim, blocking=False)
    assert isinstance(first, SaveHandle)
    first.result()
    # The frozen weight is known now: the next snapshot copies the head, its optimizer state
    # and the frozen bias (below the cache's 64 KiB, so never cached), not the 256 KiB weight.
    trainable = sum(p.numel() * p.element_size() for p in model.head.parameters())
    moments = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values())
    second = ckpt.save("adapter", model, optim, blocking=False)
    assert isinstance(second, SaveHandle)
    assert second.staged_bytes == trainable + moments + 256 * 4
    assert first.staged_bytes > second.staged_bytes + 256 * 256 * 4 - 1
    assert second.result().version == 2
    assert ckpt._background.nbytes == second.staged_bytes  # the buffers the next save reuses


def test_a_background_save_stores_only_what_changed_since_the_last(backend: Backend) -> None:
    # The frozen bias (1 KiB, below the cache's 64 KiB) is staged at every save, into the same
    # buffer: a copy rewritten at every save must not make it, nor anything else, look changed.
    ckpt = backend.client
    model = Adapter()
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)

    def step() -> None:
        model.head(torch.randn(2, 256)).sum().backward()
        optim.step()
        optim.zero_grad()

    step()
    assert ckpt.save("adapter", model, optim, blocking=False).result().version == 1
    step()
    stepped = ckpt.save("adapter", model, optim, blocking=False).result()
    unchanged = ckpt.save("adapter", model, optim, blocking=False).result()
    head = sum(p.numel() * p.element_size() for p in model.head.parameters())
    moments = sum(s[k].numel() * s[k].element_size() for s in optim.state.values() for k in ("exp_avg", "exp_avg_sq"))
    step_bytes = 4  # both parameters' steps are one value: stored once
    # The head and its optimizer state alone, in one shard:
    assert (stepped.shards, stepped.bytes_new) == (1, head + moments + step_bytes)
    assert (unchanged.shards, unchanged.bytes_new, unchanged.bytes_stored) == (0, 0, 0)
    expected = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    fresh = Adapter()
    fresh.base.bias.data.zero_()
    ckpt.load("adapter", unchanged.version, model=fresh)
    assert all(tensors_equal(v, expected[f"model/{k}"]) for k, v in fresh.state_dict().items())


def test_closing_the_client_lets_go_of_its_staging_buffers(tmp_path: Path) -> None:
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    ckpt = client.Client(home=tmp_path)
    handle = ckpt.save("bg", model, optim, blocking=False)
    assert isinstance(handle, SaveHandle)
    assert ckpt._background.nbytes == handle.staged_bytes > 0
    ckpt.close()  # waits for the save, then frees what it staged into
    assert handle.done() and handle.result().version == 1
    assert ckpt._background.nbytes == 0


def _fail_next_commit(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> None:
    """The store's next commit fails: a full disk on the embedded store (the staging write of
    the first shard), a commit refused for every transport."""
    if backend.name == "embedded":
        fail_staging_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
        return
    transport: Any = backend.client.transport
    real = transport.commit

    def refused(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(transport, "commit", real)
        raise StorageError("storage is unavailable; retry shortly")

    monkeypatch.setattr(transport, "commit", refused)


def test_an_error_is_raised_by_result_and_by_the_next_save_if_nobody_collected_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = backend.client
    model = TinyNet()
    _fail_next_commit(monkeypatch, backend)
    failed = ckpt.save("err", model, blocking=False)
    assert isinstance(failed, SaveHandle)
    with pytest.raises(StorageError):
        failed.result()
    assert ckpt.save("err", model).version == 1  # collected: the next save goes ahead
    _fail_next_commit(monkeypatch, backend)
    uncollected = ckpt.save("err", TinyNet(seed=3), blocking=False)
    assert isinstance(uncollected, SaveHandle)
    assert uncollected.wait()
    with pytest.raises(StorageError):
        ckpt.save("err", model)
    assert [v.version for v in ckpt.versions("err")] == [1]
    assert ckpt.save("err", model).version == 2


def test_a_bad_metric_is_refused_by_save_itself(backend: Backend) -> None:
    with pytest.raises(client.InvalidManifestError, match="loss"):
        backend.client.save("bad", TinyNet(), metrics={"loss": "low"}, blocking=False)  # type: ignore[dict-item]
    assert backend.client.runs() == []


SCRIPT = """
import os, sys, threading, torch
from ckptstore import client
from tests.client.models import TinyNet, train
ckpt = client.Client({where})
model = TinyNet()
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
train(model, optim, range(2))
transport = ckpt.transport
hook = {hook!r}
if hook:
    real = getattr(transport, hook)
    first = threading.Lock()  # uploads run on several threads: one announces, all wait
    def stalled(*args, **kwargs):
        if first.acquire(blocking=False):
            print("in " + hook, flush=True)
        sys.stdin.read()  # until killed
        return real(*args, **kwargs)
    setattr(transport, hook, stalled)
handle = ckpt.save("killed", model, optim, blocking=False)
print("returned", flush=True)
"""


def _child(where: str, hook: str, tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(SCRIPT.format(where=where, hook=hook)))
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**_environment(), "PYTHONPATH": str(root)},
    )


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")} | {
        "CKPTSTORE_DISABLE_PROGRESS_BARS": "1"
    }


def _where(backend: Backend) -> str:
    transport: Any = backend.client.transport
    if backend.name == "embedded":
        return f"home={str(transport.staging_dir.parent)!r}"
    return repr(transport.url)


@pytest.mark.slow  # a saving subprocess killed, on every backend
@pytest.mark.parametrize("hook", ["put_shard", "commit"])
def test_a_process_killed_during_a_background_save_leaves_no_version(
    backend: Backend, tmp_path: Path, hook: str
) -> None:
    child = _child(_where(backend), hook, tmp_path)
    assert child.stdout is not None
    lines = []
    for line in child.stdout:  # the child says when save() returned and when the hook is reached
        lines.append(line.strip())
        if line.startswith("in "):
            break
    child.kill()
    child.wait(timeout=60)
    assert lines[-1] == f"in {hook}" and "returned" in lines, lines
    assert backend.client.runs() == [] or backend.client.versions("killed") == []
    model = TinyNet()
    assert backend.client.save("killed", model).version == 1
    fresh = TinyNet(seed=5)
    backend.client.load("killed", model=fresh)
    assert all(tensors_equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow  # a saving subprocess run to its exit, on every backend
def test_the_process_waits_for_a_pending_background_save_at_exit(backend: Backend, tmp_path: Path) -> None:
    child = _child(_where(backend), "", tmp_path)
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0 and "returned" in out
    [version] = backend.client.versions("killed")
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    _assert_loads_as(backend.client, "killed", version.version, _state(model, optim))


def test_a_snapshot_of_accelerator_tensors_only_reads_host_tensors_live_and_saves_the_same(tmp_path: Path) -> None:
    """A blocking save of a model on a GPU copies only the accelerator tensors into staging
    (``host_too=False``); host tensors are read live, and the version is the one a plain save
    makes, frozen host weights taught to the digest cache as a plain save teaches them."""
    from ckptstore.client.state import flatten

    model = TinyNet(width=128)
    model.body[0].requires_grad_(False)  # 128 KiB frozen weight: the digest cache may hold it
    optim = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    train(model, optim, range(2))
    with client.Client(home=tmp_path / "plain") as plain, client.Client(home=tmp_path / "staged") as staged:
        plain.save("run", model, optim)
        flat = flatten(model, optim, None, None)
        snapshot = staged._background.staging.snapshot(flat, staged.digest_cache, host_too=False)
        assert snapshot.staged_bytes == 0 and staged._background.staging.nbytes == 0
        assert all(a is b.tensor for a, b in zip(snapshot.tensors, flat.records, strict=True))
        staged._save_run("run", flat, step=None, metrics=None, tags=[], started=0.0, snapshot=snapshot).run()
        ours, theirs = plain.transport.manifest("run"), staged.transport.manifest("run")
        assert {e.key: e.digest for e in ours.tensors} == {e.key: e.digest for e in theirs.tensors}
        frozen = model.body[0].weight
        assert staged.digest_cache is not None and staged.digest_cache.get_many([frozen]) == [
            next(e.digest for e in theirs.tensors if e.key == "model/body.0.weight")
        ]
