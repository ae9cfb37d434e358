"""On a real CUDA device: background saves stage through pinned memory and record where each
tensor lives; a load places optimizer state as torch does (``step`` on the host unless fused or
capturable). Skipped where torch sees no CUDA device; ``meta`` stands in elsewhere
(tests/client/test_placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore import client
from tests.client.models import TinyNet, batch, tensors_equal

pytestmark = pytest.mark.cuda


def train(model: TinyNet, optim: torch.optim.Optimizer, steps: range) -> None:
    """Training steps on the device, with the deterministic batches of tests.client.models."""
    for step in steps:
        tokens, targets = (t.cuda() for t in batch(step))
        optim.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens), targets).backward()
        optim.step()


def _trained(fused: bool) -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet().cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    train(model, optim, range(2))
    return model, optim


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_from_cuda_records_the_device_and_loads_back_bitwise(tmp_path: Path, blocking: bool) -> None:
    model, optim = _trained(fused=False)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with client.Client(home=tmp_path) as ckpt:
        saved = ckpt.save("run", model, optim, blocking=blocking)
        if not blocking:
            assert isinstance(saved, client.SaveHandle)
            train(model, optim, range(2, 3))  # at once: the version holds the state before this step
            saved.result()
        manifest = ckpt.transport.manifest("run")
        devices = {e.key: e.device_type for e in manifest.tensors}
        assert devices["model/body.0.weight"] == "cuda"
        assert all(devices[k] == "cpu" for k in devices if k.endswith("/step"))
        fresh = TinyNet(seed=5).cuda()
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        ckpt.load("run", model=fresh, optim=fresh_optim, device="cuda")
    for key, value in expected.items():
        assert tensors_equal(fresh.state_dict()[key], value), key
    for state in fresh_optim.state.values():
        assert state["step"].device.type == "cpu"
        assert state["exp_avg"].device.type == "cuda"


def test_a_fused_optimizer_keeps_step_on_the_device(tmp_path: Path) -> None:
    model, optim = _trained(fused=True)
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model, optim)
        fresh = TinyNet(seed=5).cuda()
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
        ckpt.load("run", model=fresh, optim=fresh_optim, device="cuda")
    assert all(state["step"].device.type == "cuda" for state in fresh_optim.state.values())
    train(fresh, fresh_optim, range(2, 3))  # the fused kernel accepts the placement


def test_frozen_tensors_on_the_device_are_sampled_in_one_gather_and_changes_are_seen(tmp_path: Path) -> None:
    from ckptstore.client.saving import hashing

    torch.manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64]
    tensors = [torch.randint(0, 100, (300, 7)).to(dtype).cuda() for dtype in dtypes]
    tensors += [tensors[0].t(), tensors[1][::3], torch.empty(0, device="cuda")]
    assert hashing.gathered_samples(tensors) == [hashing.sample(t) for t in tensors]

    model = TinyNet(width=128).cuda().requires_grad_(False)  # body.0.weight: 128 KiB, cached
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        ckpt.save("run", model, blocking=False).result()  # the frozen weights now come from the cache
        model.body[0].weight.data[:, :] += 1  # through .data: the version counter stays put
        ckpt.save("run", model, blocking=False).result()
        loaded = ckpt.load("run").state_dict
    assert loaded is not None and torch.equal(loaded["body.0.weight"], model.body[0].weight.cpu())


class Wide(torch.nn.Module):
    """Many megabytes in tensors of a few sizes: a load of it has copies in flight while it reads."""

    def __init__(self, count: int = 48, rows: int = 1024) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rows, rows)) for _ in range(count))


def test_a_kernel_launched_right_after_a_load_reads_the_loaded_values(tmp_path: Path) -> None:
    """The copies go on a side stream; the caller's stream waits for them when load returns."""
    torch.manual_seed(0)
    saved = Wide()
    expected = [p.detach().cuda() for p in saved.weights]
    torch.cuda.synchronize()

    def differing(tensors: list[torch.Tensor]) -> int:
        """Elements that differ from the saved ones, counted by kernels on the caller's stream."""
        return int(sum((t != e).sum() for t, e in zip(tensors, expected, strict=True)).item())

    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", saved)
        for _ in range(3):
            target = Wide().cuda()
            with torch.no_grad():
                for parameter in target.weights:
                    parameter.zero_()
            ckpt.load("run", model=target, device="cuda")
            assert differing(list(target.weights)) == 0  # no synchronize before
            state = ckpt.load("run", device="cuda").state_dict  # a new state_dict on the device
            assert state is not None
            assert differing([state[f"weights.{i}"] for i in range(48)]) == 0


def test_a_load_stages_through_pinned_blocks_it_reuses_and_gives_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Wide()
    optim = torch.optim.AdamW(saved.parameters())
    saved.weights[0].sum().backward()
    optim.step()

    def held_blocks() -> int:
        """Pinned blocks still in use once every copy has finished (freed ones are let go)."""
        torch.cuda.synchronize()
        torch._C._host_emptyCache()  # type: ignore[attr-defined]  # handles pending events, frees cached blocks
        return int(torch.cuda.host_memory_stats()["active_requests.current"])

    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", saved, optim)
        before = held_blocks()
        pinned: list[int] = []
        loaded = []
        for _ in range(3):
            target = Wide().cuda()
            target_optim = torch.optim.AdamW(target.parameters())
            ckpt.load("run", model=target, optim=target_optim, device="cuda")
            torch.cuda.synchronize()
            pinned.append(torch.cuda.host_memory_stats()["allocated_bytes.current"])
            state = target_optim.state[target.weights[0]]
            assert state["exp_avg"].device.type == "cuda" and state["step"].device.type == "cpu"
            assert not state["step"].is_pinned()  # kept on the host: pageable, not a pinned block
            loaded.append((target, target_optim))
        # Every block is handed back, though the loaded models and optimizers are all still alive.
        assert held_blocks() == before
    # The blocks of one load serve the next: pinned memory does not grow with the loads, and it is
    # bounded by the reads in flight (at most eight of 64 MiB ahead), not the 576 MiB loaded.
    assert 0 < pinned[0] <= 1 << 30 and max(pinned) <= pinned[0] * 5 // 4


@pytest.mark.parametrize("packed", [True, False])
def test_a_background_save_stores_the_state_before_steps_taken_at_once_on_another_stream(
    tmp_path: Path, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live tensors may change as soon as save returns, on any stream: the caller waited
    for the copies that read them (gathered on the device, or one transfer each past the limit)."""
    from ckptstore.client.saving import packed_staging

    if not packed:
        monkeypatch.setattr(packed_staging, "LIMIT_BYTES", 1024)
    model, optim = _trained(fused=False)
    with client.Client(home=tmp_path) as ckpt:
        for step in range(3):
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
            moments = [s["exp_avg"].clone() for s in optim.state.values()]
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, client.SaveHandle)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):  # not ordered after the save's copies by the stream itself
                train(model, optim, range(3 + step, 4 + step))
            handle.result()
            loaded = ckpt.load("run")
            assert loaded.state_dict is not None
            for key, value in expected.items():
                assert tensors_equal(loaded.state_dict[key].cuda(), value), key
            fresh = TinyNet(seed=5).cuda()
            fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            ckpt.load("run", model=fresh, optim=fresh_optim, device="cuda")
            for state, moment in zip(fresh_optim.state.values(), moments, strict=True):
                assert torch.equal(state["exp_avg"], moment)
            torch.cuda.synchronize()


def test_background_saves_from_the_device_reuse_their_pinned_buffers(tmp_path: Path) -> None:
    model, optim = _trained(fused=False)
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model, optim)
        held = []
        for step in range(4):
            train(model, optim, range(2 + step, 3 + step))
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, client.SaveHandle) and handle.staged_bytes > 0
            handle.result()
            torch.cuda.synchronize()
            held.append((ckpt._background.nbytes, torch.cuda.host_memory_stats()["allocated_bytes.current"]))
    staged = handle.staged_bytes
    assert all(nbytes == held[0][0] for nbytes, _ in held) and staged <= held[0][0] <= staged + 64 * 64
    assert all(pinned == held[0][1] for _, pinned in held)  # the same blocks, save after save


def test_a_save_process_stores_the_device_state_as_it_was_when_save_returned(tmp_path: Path) -> None:
    """With ``background="process"`` the copies go through a shared file registered as pinned
    memory; steps taken at once on another stream do not reach the version."""
    model, optim = _trained(fused=False)
    with client.Client(home=tmp_path, background="process") as ckpt:
        for step in range(3):
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, client.SaveHandle)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                train(model, optim, range(3 + step, 4 + step))
            handle.result()
            torch.cuda.synchronize()
            manifest = ckpt.transport.manifest("run")
            assert {e.key: e.device_type for e in manifest.tensors}["model/body.0.weight"] == "cuda"
            fresh = TinyNet(seed=5).cuda()
            ckpt.load("run", model=fresh, device="cuda")
            for key, value in expected.items():
                assert tensors_equal(fresh.state_dict()[key], value), key


def test_saves_from_the_device_that_come_often_move_to_a_save_process_losing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``background="auto"`` (the default) on a device: the first saves stage through the thread's
    pinned buffers, the run's fourth starts a save process, and the saves after it go through
    its shared file; every version holds the device state as it was when its save returned."""
    from ckptstore.client.saving import cadence

    monkeypatch.delenv(cadence.VARIABLE, raising=False)
    model, optim = _trained(fused=False)
    expected = []
    with client.Client(home=tmp_path) as ckpt:
        for step in range(cadence.RUN_LENGTH + 2):
            expected.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            handle = ckpt.save("run", model, optim, blocking=False)
            assert isinstance(handle, client.SaveHandle)
            train(model, optim, range(3 + step, 4 + step))  # at once, on the same stream
            handle.result()
            starting = ckpt._background._starting
            if step == cadence.RUN_LENGTH - 1:
                assert starting is not None and starting.started.wait(120) and starting.start_error is None
        process = ckpt._background.process
        assert process is not None and process.answered  # the last saves went through it
        torch.cuda.synchronize()
        for version, state in enumerate(expected, start=1):
            fresh = TinyNet(seed=5).cuda()
            ckpt.load("run", version=version, model=fresh, device="cuda")
            for key, value in state.items():
                assert tensors_equal(fresh.state_dict()[key], value), (version, key)
