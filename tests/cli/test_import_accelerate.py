"""Accelerate ``save_state`` folders, made by the real ``accelerate``: imported whole (weights, optimizer by
position, schedulers, generators, registered objects, data loader state), resumed by the Accelerate
plug-in's ``load_state`` and, exported back with ``--format accelerate``, by accelerate's own
``Accelerator.load_state``: the next steps equal continuing from the original folder, bit for bit."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accelerate
import numpy as np
import pytest
import torch
from accelerate.utils import DataLoaderConfiguration
from torch import nn

from ckptstore.client.integrations.accelerate import load_state
from ckptstore.service.errors import StateMismatchError
from tests.cli.conftest import Cli

K, N = 5, 11


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # Two layers of one shape: only the optimizer's own order tells their state apart.
        self.body = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Dropout(0.2), nn.Linear(6, 6), nn.Linear(6, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Counter:
    """An object registered for checkpointing: plain data in its state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "note": "batches"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


@dataclass
class Opaque:
    """What a registered object's state must not be for the import to keep it: an object of a class."""

    seen: int = 0


class OpaqueHolder:
    def __init__(self) -> None:
        self.state = Opaque()

    def state_dict(self) -> Opaque:
        return self.state

    def load_state_dict(self, state: Opaque) -> None:
        self.state = state


@dataclass
class Job:
    accelerator: Any
    model: nn.Module
    optim: Any
    scheduler: Any
    counter: Counter


def prepared(seed: int) -> Job:
    """A fresh job: model, AdamW over the layers in an order unlike the model's, a scheduler, a counter."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = Net(seed)
    layers = list(model.body)
    params = [*layers[3].parameters(), *layers[0].parameters(), *layers[4].parameters()]
    optim = torch.optim.AdamW([{"params": params[:2], "lr": 2e-2}, {"params": params[2:]}], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.05, total_steps=N)
    model, optim, scheduler = accelerator.prepare(model, optim, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return Job(accelerator, model, optim, scheduler, counter)


def train(job: Job, steps: range) -> list[float]:
    """Steps whose batches come from torch's, NumPy's and Python's global generators, as dropout's do."""
    job.model.train()
    losses = []
    for _ in steps:
        x = torch.randn(8, 6) * float(np.random.uniform(0.5, 1.5)) + random.random()
        job.optim.zero_grad()
        loss = nn.functional.mse_loss(job.model(x), x.sum(dim=1, keepdim=True))
        job.accelerator.backward(loss)
        job.optim.step()
        job.scheduler.step()
        job.counter.seen += 1
        losses.append(loss.item())
    return losses


def reseed(seed: int) -> None:
    """Generators somewhere else: only a restore puts the saved streams back."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def saved_folder(folder: Path, *, safe_serialization: bool = True) -> None:
    job = prepared(0)
    reseed(1)
    train(job, range(K))
    job.accelerator.save_state(str(folder), safe_serialization=safe_serialization)


def continued_from(folder: Path) -> tuple[list[float], Job]:
    """The reference: accelerate's own ``load_state`` of the folder, then the next steps."""
    job = prepared(3)
    reseed(33)
    job.accelerator.load_state(str(folder))
    return train(job, range(K, N)), job


def assert_same(ours: tuple[list[float], Job], reference: tuple[list[float], Job]) -> None:
    (losses, job), (expected_losses, expected) = ours, reference
    assert losses == expected_losses
    assert all(torch.equal(t, expected.model.state_dict()[k]) for k, t in job.model.state_dict().items())
    assert job.counter.seen == expected.counter.seen == N
    assert job.scheduler.scheduler.state_dict() == expected.scheduler.scheduler.state_dict()
    for mine, theirs in zip(job.optim.optimizer.param_groups, expected.optim.optimizer.param_groups, strict=True):
        assert mine["lr"] == theirs["lr"]
        for p, q in zip(mine["params"], theirs["params"], strict=True):
            state, expected_state = job.optim.optimizer.state[p], expected.optim.optimizer.state[q]
            assert all(torch.equal(v, expected_state[k]) for k, v in state.items())


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_the_plugin_resumes_an_imported_folder_bit_for_bit(cli: Cli, tmp_path: Path, safe_serialization: bool) -> None:
    folder = tmp_path / "checkpoint"
    saved_folder(folder, safe_serialization=safe_serialization)
    reference = continued_from(folder)

    report = json.loads(cli.ok("import", folder, "acc", "--json"))
    assert report["left_out"] == {}
    assert report["optimizer_parameters"] == 6 and report["scheduler"]
    assert report["extra"] == ["accelerator_step", "custom", "rng", "schedulers"]

    job = prepared(7)
    reseed(77)
    load_state(job.accelerator, "acc", client=cli.client)
    assert_same((train(job, range(K, N)), job), reference)


def test_an_exported_folder_resumes_in_accelerate_bit_for_bit(cli: Cli, tmp_path: Path) -> None:
    folder, exported = tmp_path / "checkpoint", tmp_path / "exported"
    saved_folder(folder)
    reference = continued_from(folder)
    cli.ok("import", folder, "acc")

    out = cli.ok("export", "acc", exported, "--format", "accelerate")
    assert "as accelerate" in out
    names = sorted(p.name for p in exported.iterdir())
    assert names == [
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "scheduler.bin",
    ]
    assert_same(continued_from(exported), reference)


def test_a_plugin_version_exports_as_a_folder_accelerate_resumes(cli: Cli, tmp_path: Path) -> None:
    """State the plug-in stored by parameter name is numbered in the optimizer's own order."""
    from ckptstore.client.integrations.accelerate import save_state

    job = prepared(0)
    reseed(1)
    train(job, range(K))
    save_state(job.accelerator, "plugin", client=cli.client)
    expected = train(job, range(K, N)), job

    cli.ok("export", "plugin", tmp_path / "exported", "--format", "accelerate")
    assert_same(continued_from(tmp_path / "exported"), expected)


def loader_job(seed: int) -> tuple[Any, Any]:
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    _, loader = accelerator.prepare(Net(seed), loader)
    return accelerator, loader


def resumed_batches(folder: Path) -> list[torch.Tensor]:
    """The rest of the epoch after accelerate's own ``load_state`` of ``folder``."""
    accelerator, loader = loader_job(9)
    accelerator.load_state(str(folder))
    return [batch[0] for batch in loader]


def test_a_stateful_loader_goes_on_at_the_same_batch_after_the_round_trip(cli: Cli, tmp_path: Path) -> None:
    folder, exported = tmp_path / "checkpoint", tmp_path / "exported"
    accelerator, loader = loader_job(0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    accelerator.save_state(str(folder))
    assert (folder / "dl_state_dict.bin").exists()
    expected = resumed_batches(folder)

    report = json.loads(cli.ok("import", folder, "loader", "--json"))
    assert "dataloader_states" in report["extra"] and report["left_out"] == {}
    cli.ok("export", "loader", exported, "--format", "accelerate")
    assert (exported / "dl_state_dict.bin").exists()

    resumed = resumed_batches(exported)
    assert len(resumed) == len(expected) == 7  # the 3 batches served before the save are skipped
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))


def test_what_cannot_be_kept_is_left_out_with_the_true_reason(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    job = prepared(0)
    job.accelerator.register_for_checkpointing(OpaqueHolder())
    train(job, range(2))
    job.accelerator.save_state(str(folder))
    (folder / "random_states_1.pkl").write_bytes((folder / "random_states_0.pkl").read_bytes())

    report = json.loads(cli.ok("import", folder, "opaque", "--json"))
    assert report["extra"] == ["accelerator_step", "custom_checkpoint_0", "rng", "schedulers"]
    left_out = report["left_out"]
    assert set(left_out) == {"custom_checkpoint_1.pkl", "random_states_1.pkl"}
    assert "Opaque" in left_out["custom_checkpoint_1.pkl"] and left_out["custom_checkpoint_1.pkl"].startswith(
        "not read: "
    )
    assert left_out["random_states_1.pkl"].startswith("process 1's random number generators")
    # Without every registered object's state, the plug-in refuses rather than restoring some.
    fresh = prepared(3)
    fresh.accelerator.register_for_checkpointing(OpaqueHolder())
    with pytest.raises(StateMismatchError, match="holds 0 registered objects, the accelerator has 2"):
        load_state(fresh.accelerator, "opaque", client=cli.client)
