"""On a real CUDA device: background saves stage through pinned memory and record where each
tensor lives; a load places optimizer state as torch does (``step`` on the host unless fused or
capturable). Skipped where torch sees no CUDA device; ``meta`` stands in elsewhere
(tests/client/test_placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import client
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
