"""Background saves in a save process (``Client(background="process")``): the same versions as
saves on the client's thread, from a shared file; a fallback to the thread when the store lacks a
tensor only the live model holds; a killed helper fails its save alone; nothing left behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.client import SaveHandle
from ckptstore.client.saving import save_process, shared_staging
from tests.client.models import Adapter, TinyNet, loaded_tiny, same_state, state_copy, tensors_equal, train


@contextmanager
def saved_once(home: Path) -> Iterator[tuple[client.Client, TinyNet, torch.optim.Optimizer, save_process.SaveProcess]]:
    """A client of ``home`` with a save process, a trained TinyNet and its optimizer, after one
    background save the helper made (version 1)."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    with client.Client(home=home, background="process") as ckpt:
        first = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(first, SaveHandle) and first.result().version == 1
        process = ckpt._background.process
        assert process is not None and process.pid is not None
        yield ckpt, model, optim, process


def _files() -> set[Path]:
    return set(shared_staging.shared_folder().glob(f"{shared_staging.PREFIX}{os.getpid()}-*"))


def test_a_save_process_stores_what_a_save_on_the_thread_stores(tmp_path: Path) -> None:
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    before = _files()
    with (
        client.Client(home=tmp_path / "thread", background="thread") as plain,
        client.Client(home=tmp_path / "process", background="process") as helped,
    ):
        expected = []
        for step in range(3):
            expected.append(state_copy(model, optim))
            handles = [c.save("run", model, optim, step=step, blocking=False) for c in (plain, helped)]
            train(model, optim, range(2 + step, 3 + step))  # at once: the versions hold the state before
            results = [h.result() for h in handles if isinstance(h, SaveHandle)]
            assert [r.version for r in results] == [step + 1, step + 1]
        assert helped._background.process is not None and helped._background.process.pid is not None
        for version, state in enumerate(expected, start=1):
            ours, theirs = plain.transport.manifest("run", version), helped.transport.manifest("run", version)
            assert {e.key: e.digest for e in ours.tensors} == {e.key: e.digest for e in theirs.tensors}
            assert ours.state == theirs.state and theirs.step == version - 1
            assert same_state(loaded_tiny(helped, version), state)
        assert len(_files() - before) == 1  # one shared file, reused save after save
        process = helped._background.process
    assert process.pid is None and _files() == before  # closing ends the helper and removes the file


def test_a_tensor_the_store_lost_is_saved_from_the_live_model_on_the_thread(tmp_path: Path) -> None:
    """The digest cache knows the frozen weight, so the snapshot does not stage it; once another
    client deleted every version holding it and collected, the helper cannot save it, and the
    client saves on its own thread, reading the live weight."""
    model = Adapter()
    optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    with client.Client(home=tmp_path, background="process") as ckpt, client.Client(home=tmp_path) as other:
        ckpt.save("run", model, optim)
        handle = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(handle, SaveHandle) and handle.result().version == 2
        assert handle.staged_bytes < 256 * 256 * 4  # the frozen weight came from the cache
        for version in (1, 2):
            other.delete("run", version)
        assert other.gc(grace_seconds=0).tensors_swept > 0
        handle = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(handle, SaveHandle) and handle.result().version == 3
        fresh = Adapter()
        with torch.no_grad():
            fresh.base.weight.zero_()
        ckpt.load("run", model=fresh)
        assert tensors_equal(fresh.base.weight, model.base.weight)


def test_a_killed_save_process_fails_its_save_and_the_next_save_starts_another(tmp_path: Path) -> None:
    with saved_once(tmp_path) as (ckpt, model, optim, process):
        killed = process.pid
        os.kill(killed, signal.SIGKILL)
        broken = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(broken, SaveHandle)
        with pytest.raises(client.StorageError, match="save process ended"):
            broken.result()
        train(model, optim, range(2, 3))
        expected = state_copy(model, optim)
        again = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(again, SaveHandle)
        version = again.result().version
        assert process.pid not in (None, killed)
        assert [v.version for v in ckpt.versions("run")] == [1, version]
        assert same_state(loaded_tiny(ckpt, version), expected)


def test_closing_ends_the_save_process_while_another_process_holds_its_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process forked from the training process (a data loader's worker) holds a copy of every
    descriptor, the save process's input among them, so closing that input ends nothing: the
    client asks the helper to exit instead, and it does, rather than being killed after
    CLOSE_SECONDS."""
    monkeypatch.setattr(save_process, "CLOSE_SECONDS", 5.0)  # the kill it must not come to, made quick
    with saved_once(tmp_path) as (_, _, _, process):
        helper = process._process
        assert helper is not None and helper.stdin is not None
        holder = subprocess.Popen(  # holds the write end of the helper's input, as a fork would
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            pass_fds=(helper.stdin.fileno(),),
        )
    try:
        assert helper.returncode == 0  # it exited when asked: not killed (-9)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)


def test_the_save_process_imports_the_clients_package_whatever_folder_it_runs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named ``ckptstore`` or ``client`` in the working folder (a project's own package) is
    not what the helper imports: it runs the package the client runs."""
    work = tmp_path / "project"
    for name in ("ckptstore", "client"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text("raise ImportError('a project package of the same name')\n")
    monkeypatch.chdir(work)
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    expected = state_copy(model, optim)
    with client.Client(home=tmp_path / "store", background="process") as ckpt:
        handle = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(handle, SaveHandle) and handle.result().version == 1
        process = ckpt._background.process
        assert process is not None and process.answered  # the helper saved it
        assert same_state(loaded_tiny(ckpt, 1), expected)


def test_ctrl_c_in_the_terminal_leaves_the_save_process_to_the_client(tmp_path: Path) -> None:
    """Ctrl-C interrupts every process of the terminal's foreground job, the helper too (here the
    signal is sent to it alone): the helper lets it pass, the client's saves go on through it, as
    they go on on the client's thread, and the client still ends it on close."""
    with saved_once(tmp_path) as (ckpt, model, optim, process):
        helper = process.pid
        assert helper is not None
        os.kill(helper, signal.SIGINT)
        train(model, optim, range(2, 3))
        expected = state_copy(model, optim)
        after = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(after, SaveHandle) and after.result().version == 2
        assert process.pid == helper  # the same helper answered
        assert same_state(loaded_tiny(ckpt, 2), expected)
    assert process.pid is None


def test_the_helpers_path_has_no_working_folder_and_the_standard_library_first(tmp_path: Path) -> None:
    """The path the helper's bootstrap leaves: without the working folder (where a project's own
    ``ckptstore`` folder could stand in for the package), the standard library ahead of site-packages."""
    show = save_process.BOOTSTRAP + "import json; print(json.dumps(sys.path))"
    done = subprocess.run([sys.executable, "-c", show], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    path = json.loads(done.stdout)
    stdlib, site_packages = str(Path(os.__file__).parent), str(Path(torch.__file__).parents[1])
    assert path.index(stdlib) < path.index(site_packages)
    assert all(p not in ("", ".", str(tmp_path)) for p in path)


def test_the_save_process_error_comes_back_with_its_class_and_the_next_save_goes_ahead(tmp_path: Path) -> None:
    """The manifest is built and checked in the helper: a name the format cannot hold fails that
    save's handle with the error a save on the thread raises."""
    model = nn.Module()
    model.add_module("x" * 1100, nn.Linear(2, 2))  # a key longer than the format holds
    with client.Client(home=tmp_path, background="process") as ckpt:
        failed = ckpt.save("run", model, blocking=False)
        assert isinstance(failed, SaveHandle)
        with pytest.raises(client.InvalidManifestError, match="tensors/0/key"):
            failed.result()
        fine = ckpt.save("run", TinyNet(), blocking=False)
        assert isinstance(fine, SaveHandle) and fine.result().version == 1


def test_a_background_mode_of_another_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(client.InvalidInputError, match="'thread' or 'process'"):
        client.Client(home=tmp_path, background="processes")  # type: ignore[arg-type]


EXITING = """
import torch
from ckptstore import client
from tests.client.models import TinyNet, train
ckpt = client.Client(home={home!r}, background="process")
model = TinyNet()
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
train(model, optim, range(2))
ckpt.save("run", model, optim, blocking=False)
print("returned", flush=True)
"""


KILLED = """
import os, signal, subprocess, sys
import torch
from ckptstore import client
from tests.client.models import TinyNet, train
ckpt = client.Client(home={home!r}, background="process")
model = TinyNet()
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
train(model, optim, range(2))
ckpt.save("run", model, optim, blocking=False).result()
helper = ckpt._background.process._process
holder = subprocess.Popen(  # holds the helper's input open, as a worker forked from this process would
    [sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL, pass_fds=(helper.stdin.fileno(),)
)
print(helper.pid, holder.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie nobody reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_save_process_whose_client_is_killed_ends_though_its_input_stays_open(tmp_path: Path) -> None:
    """The client's process is killed (no end line) while another process holds the helper's input
    open (no end of input): the helper sees its parent gone and ends, within a few checks."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(KILLED.format(home=str(tmp_path / "store"))))
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env |= {"CKPTSTORE_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(root)}
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:  # files, not pipes the helper would hold open
        command = [sys.executable, str(script)]
        done = subprocess.run(command, cwd=root, stdout=stdout, stderr=stderr, env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    helper, holder = (int(pid) for pid in out.read_text().split())
    try:
        deadline = time.monotonic() + 60 * save_process.PARENT_CHECK_SECONDS
        while not _gone(helper) and time.monotonic() < deadline:
            threading.Event().wait(save_process.PARENT_CHECK_SECONDS / 4)  # a bounded wait for its end
        assert _gone(helper)
        assert not _gone(holder)  # it still held the input: the helper ended on its own
    finally:
        os.kill(holder, signal.SIGKILL)


@pytest.mark.slow  # a saving subprocess run to its exit
def test_a_process_exiting_with_a_save_in_its_save_process_waits_for_it(tmp_path: Path) -> None:
    before = set(shared_staging.shared_folder().glob(f"{shared_staging.PREFIX}*"))
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(EXITING.format(home=str(tmp_path / "store"))))
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env |= {"CKPTSTORE_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr[-2000:]
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    with client.Client(home=tmp_path / "store") as ckpt:
        assert [v.version for v in ckpt.versions("run")] == [1]
        assert same_state(loaded_tiny(ckpt, 1), state_copy(model, optim))
    assert set(shared_staging.shared_folder().glob(f"{shared_staging.PREFIX}*")) <= before  # removed at exit


def test_a_shared_folder_without_room_leaves_the_save_to_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's small ``/dev/shm`` cannot back the snapshot: the space is reserved before
    any copy (no SIGBUS on a page it cannot back), and the save runs on the client's thread."""

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shared_staging.os, "posix_fallocate", full)
    model = TinyNet()
    before = _files()
    with client.Client(home=tmp_path, background="process") as ckpt:
        expected = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
        handle = ckpt.save("run", model, blocking=False)
        assert isinstance(handle, SaveHandle) and handle.result().version == 1
        assert ckpt._background.process is not None and ckpt._background.process.pid is None  # never started
        assert _files() == before
        fresh = TinyNet(seed=7)
        ckpt.load("run", model=fresh)
        assert all(tensors_equal(fresh.state_dict()[k[len("model/") :]], v) for k, v in expected.items())


def test_the_shared_file_is_readable_by_its_owner_alone(tmp_path: Path) -> None:
    model = TinyNet()
    with client.Client(home=tmp_path, background="process") as ckpt:
        handle = ckpt.save("run", model, blocking=False)
        assert isinstance(handle, SaveHandle)
        handle.result()
        mine = _files()
        assert mine and all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in mine)


def test_records_and_state_the_helper_holds_are_not_sent_again_and_a_change_is(tmp_path: Path) -> None:
    """The helper keeps the last save's records and state; the client sends them again only
    when they change (a buffer added to the model, the learning rate), and a new helper gets
    them whole."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    with client.Client(home=tmp_path, background="process") as ckpt:
        expected = []
        for change in ("none", "same", "buffer", "same", "lr", "kill", "same"):
            if change == "buffer":
                model.register_buffer("seen", torch.arange(5.0))
            elif change == "lr":
                optim.param_groups[0]["lr"] = 3e-3
            elif change == "kill":
                process = ckpt._background.process
                assert process is not None and process.pid is not None
                os.kill(process.pid, signal.SIGKILL)
                with pytest.raises(client.StorageError):
                    handle = ckpt.save("run", model, optim, blocking=False)
                    assert isinstance(handle, SaveHandle)
                    handle.result()
                continue
            expected.append((state_copy(model, optim), optim.param_groups[0]["lr"]))
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, SaveHandle) and handle.result().version == len(expected)
        for version, (state, lr) in enumerate(expected, start=1):
            fresh = TinyNet(seed=7)
            if "model/seen" in state:
                fresh.register_buffer("seen", torch.zeros(5))
            fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1.0)
            ckpt.load("run", version, model=fresh, optim=fresh_optim)
            assert same_state(state_copy(fresh, fresh_optim), state), version
            assert fresh_optim.param_groups[0]["lr"] == lr


def _live(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The live tensors of a save, by key."""
    names = {id(p): n for n, p in model.named_parameters()}
    live = {f"model/{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    for param, values in optim.state.items():
        live |= {f"optim/state/{names[id(param)]}/{k}": v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return live


def test_the_helper_is_told_which_staged_tensors_changed_in_place_and_stores_only_those(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper sees copies only: the client, which follows the live tensors, names those
    changed in place since its last save, and the helper writes them at once (hashed as they
    are written). A save with nothing changed names none and stores nothing."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    sent: list[dict[str, Any]] = []
    real = save_process.SaveProcess.save

    def save(helper: save_process.SaveProcess, message: dict[str, Any]) -> dict[str, Any]:
        sent.append(message)
        return real(helper, message)

    monkeypatch.setattr(save_process.SaveProcess, "save", save)
    versions: list[dict[str, int]] = []
    with client.Client(home=tmp_path, background="process") as ckpt:
        results = []
        for steps in (range(2, 3), range(3, 4), range(0)):
            train(model, optim, steps)
            versions.append({key: tensor._version for key, tensor in _live(model, optim).items()})
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, SaveHandle)
            results.append(handle.result())
        assert same_state(loaded_tiny(ckpt, 3), state_copy(model, optim))
        keys = [entry.key for entry in ckpt.transport.manifest("run", 1).tensors]
    moved = sorted(key for key, version in versions[1].items() if versions[0][key] != version)
    assert moved and "model/body.0.weight" in moved and "optim/state/body.0.weight/exp_avg" in moved
    assert sent[0]["moved"] == []  # the first: nothing to compare with
    assert sorted(keys[i] for i in sent[1]["moved"]) == moved
    assert sent[2]["moved"] == [] and (results[2].shards, results[2].bytes_new) == (0, 0)
