"""Optimizer state loaded by a framework's own ``optimizer.load_state_dict`` gets its saved dtypes
back and its param_groups tensors move to their parameters' device: on ``meta`` standing in for
an accelerator, and through Lightning with prodigy-plus-schedule-free, resumed bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prodigyplus import ProdigyPlusScheduleFree
from torch import nn

from ckptstore import client
from ckptstore.client.integrations.optimizer_repair import repair_loaded_optimizer
from tests.client.models import tensors_equal

pl = pytest.importorskip("lightning.pytorch")  # the .[lightning] extra; installed in CI

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptstore.client.integrations.lightning import CkptstoreCheckpointIO, ResumeStateCallback  # noqa: E402
from tests.integrations.lightning_kit import TinyModule, loaders, trainer  # noqa: E402


def _prodigy(model: nn.Module) -> ProdigyPlusScheduleFree:
    optim = ProdigyPlusScheduleFree(model.parameters(), lr=1.0)
    optim.train()
    return optim


def _stepped() -> tuple[nn.Module, ProdigyPlusScheduleFree]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    optim = _prodigy(model)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optim.step()
    return model, optim


def test_state_dtypes_and_group_tensors_are_put_back_on_the_device() -> None:
    model, optim = _stepped()
    saved = optim.state_dict()
    target = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).to("meta")
    loaded = _prodigy(target)
    loaded.load_state_dict(saved)
    state = loaded.state[target[0].weight]
    group = loaded.param_groups[0]
    # What the stock loader leaves: bf16 state cast to fp32, group tensors still on the CPU.
    assert state["s"].dtype == torch.float32 and group["running_d_numerator"].device.type == "cpu"

    assert repair_loaded_optimizer(loaded, saved) > 0
    for param, ours in zip(target.parameters(), optim.state.values(), strict=True):
        for name, value in ours.items():
            if isinstance(value, torch.Tensor):
                repaired = loaded.state[param][name]
                assert (repaired.dtype, repaired.device.type) == (value.dtype, "meta"), name
            else:
                assert loaded.state[param][name] == value, name
    assert {v.device.type for v in group.values() if isinstance(v, torch.Tensor)} == {"meta"}


def test_step_stays_where_the_loader_put_it() -> None:
    model = nn.Linear(4, 4)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.randn(2, 4)).sum().backward()
    fused.step()
    saved = fused.state_dict()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(saved)
    placed = {k: (v.dtype, v.device) for k, v in plain.state[model.weight].items()}
    repair_loaded_optimizer(plain, saved)
    assert {k: (v.dtype, v.device) for k, v in plain.state[model.weight].items()} == placed


class ProdigyModule(TinyModule):
    """TinyModule trained by prodigy-plus-schedule-free (bf16 state, tensors in param_groups)."""

    def configure_optimizers(self) -> Any:
        return _prodigy(self)


def _fit(io: CkptstoreCheckpointIO, root: Path, callbacks: list[Any], ckpt_path: str | None = None) -> Any:
    torch.manual_seed(0)
    module = ProdigyModule()
    fit = trainer(root, epochs=3, plugins=[io], callbacks=[ModelCheckpoint(save_top_k=-1), *callbacks])
    fit.fit(module, *loaders(), ckpt_path=ckpt_path)
    return module, fit


def test_prodigy_through_lightning_resumes_bit_for_bit(ckpt: client.Client, tmp_path: Path) -> None:
    full, full_trainer = _fit(CkptstoreCheckpointIO("prodigy", client=ckpt), tmp_path / "a", [ResumeStateCallback()])
    epoch_0 = "ckptstore://prodigy@" + next(
        tag for v in ckpt.versions("prodigy") for tag in v.tags if tag.startswith("epoch_0")
    )
    resumed, resumed_trainer = _fit(
        CkptstoreCheckpointIO("prodigy", client=ckpt), tmp_path / "b", [ResumeStateCallback()], ckpt_path=epoch_0
    )
    for key, value in full.state_dict().items():
        assert tensors_equal(resumed.state_dict()[key], value), key
    theirs, ours = full_trainer.optimizers[0], resumed_trainer.optimizers[0]
    for param_full, param_resumed in zip(full.parameters(), resumed.parameters(), strict=True):
        for name, value in theirs.state[param_full].items():
            if isinstance(value, torch.Tensor):
                assert tensors_equal(ours.state[param_resumed][name], value), name
    assert any(v.dtype == torch.bfloat16 for s in ours.state.values() for v in s.values() if torch.is_tensor(v))


def test_without_the_callback_lightning_casts_prodigys_bf16_state(ckpt: client.Client, tmp_path: Path) -> None:
    _fit(CkptstoreCheckpointIO("cast", client=ckpt), tmp_path / "a", [])
    epoch_0 = "ckptstore://cast@" + next(t for v in ckpt.versions("cast") for t in v.tags if t.startswith("epoch_0"))
    seen: list[torch.dtype] = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.extend(s["s"].dtype for s in trainer.optimizers[0].state.values() if "s" in s)

    _fit(CkptstoreCheckpointIO("cast", client=ckpt), tmp_path / "b", [Spy()], ckpt_path=epoch_0)
    assert seen and set(seen) == {torch.float32}  # what ResumeStateCallback puts right
