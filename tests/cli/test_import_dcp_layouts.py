"""torchtitan's and torchtune's DCP folders, made by the real ``torch.distributed.checkpoint``: the
optimizer, scheduler and step are found under their names, ``client.load(model=, optim=)`` resumes
bit for bit against continuing the original run, and ``export --format dcp`` writes the same layout
back, so ``dcp.load`` of the framework's own state dict resumes from it.

torchtitan is not installed: :class:`ModelWrapper`, :class:`OptimizersContainer`,
:class:`SchedulersContainer` and :class:`TrainState` are small, faithful re-creations of the
``Stateful`` objects torchtitan's ``CheckpointManager`` passes to ``dcp.save`` (its
``components/checkpoint.py``, ``components/optimizer.py``, ``components/lr_scheduler.py`` and
``train.py``): the model's ``get_model_state_dict``, the optimizer's ``get_optimizer_state_dict``
with ``flatten_optimizer_state_dict=True``, the first scheduler's ``state_dict()``, and the step as
an int32 tensor. torchtune's layout is its recipes' ``state_dict`` (``model``, ``optimizer`` as
``get_optimizer_state_dict`` gives it, ``seed``, ``epochs_run``, ``total_epochs``,
``max_steps_per_epoch``).
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from ckptstore.client.formats.dcp_layouts import flatten_optimizer, unflatten_optimizer
from tests.cli.conftest import Cli

K, N = 4, 9
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@pytest.fixture(autouse=True)
def _single_process_notices() -> Iterator[None]:
    """A one-process ``dcp.save``/``load`` warns that no process group runs: expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
        yield


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # Two layers of one shape: only names tell their state apart.
        self.embed = nn.Linear(5, 5)
        self.block = nn.Linear(5, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.embed(x)))))


class ModelWrapper(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = [model]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for sd in map(get_model_state_dict, self.model) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load = functools.partial(
            set_model_state_dict, model_state_dict=state_dict, options=StateDictOptions(strict=False)
        )
        list(map(load, self.model))


class OptimizersContainer(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model_parts, self.optimizers = [model], [optim]

    def state_dict(self) -> dict[str, Any]:
        get = functools.partial(get_optimizer_state_dict, options=FLAT)
        return {k: v for sd in map(get, self.model_parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load = functools.partial(set_optimizer_state_dict, optim_state_dict=state_dict, options=FLAT)
        list(map(load, self.model_parts, self.optimizers))


class SchedulersContainer(Stateful):
    def __init__(self, scheduler: Any) -> None:
        self.schedulers = [scheduler]

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state_dict.copy())


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int32), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        self.ntokens_seen = int(state_dict["ntokens_seen"].item())


@dataclass
class Job:
    model: Net
    optim: torch.optim.AdamW
    scheduler: Any
    train_state: TrainState

    def titan_states(self) -> dict[str, Any]:
        return {
            "model": ModelWrapper(self.model),
            "optimizer": OptimizersContainer(self.model, self.optim),
            "lr_scheduler": SchedulersContainer(self.scheduler),
            "train_state": self.train_state,
        }


def job(seed: int) -> Job:
    """Two param groups in an order unlike the model's, with a warmup schedule."""
    model = Net(seed)
    groups = [
        {"params": [*model.head.parameters(), *model.block.parameters()], "lr": 3e-2, "weight_decay": 0.0},
        {"params": list(model.embed.parameters())},
    ]
    optim = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 3))
    return Job(model, optim, scheduler, TrainState())


def train(j: Job, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        j.optim.zero_grad()
        loss = nn.functional.mse_loss(j.model(x), x.sum(1, keepdim=True))
        loss.backward()
        j.optim.step()
        j.scheduler.step()
        j.train_state.step += 1
        j.train_state.ntokens_seen += 6
        losses.append(loss.item())
    return losses


def assert_same(ours: Job, theirs: Job) -> None:
    expected = theirs.model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in ours.model.state_dict().items())
    assert ours.scheduler.state_dict() == theirs.scheduler.state_dict()


def test_torchtitan_folder_resumes_bit_for_bit_and_exports_back(cli: Cli, tmp_path: Path) -> None:
    folder, exported = tmp_path / "step-4", tmp_path / "exported"
    original = job(0)
    train(original, range(K))
    dcp.save(original.titan_states(), checkpoint_id=folder, no_dist=True)
    expected = train(original, range(K, N))

    report = json.loads(cli.ok("import", folder, "titan", "--json"))
    assert report["step"] == K and report["optimizer_parameters"] == 6 and report["scheduler"]
    assert report["extra"] == ["train_state"] and report["left_out"] == {}

    resumed = job(5)
    loaded = cli.client.load("titan", model=resumed.model, optim=resumed.optim, scheduler=resumed.scheduler)
    assert loaded.step == K
    resumed.train_state.load_state_dict(loaded.extra["train_state"])
    assert train(resumed, range(K, N)) == expected
    assert_same(resumed, original)

    cli.ok("export", "titan", exported, "--format", "dcp")
    again = job(7)
    dcp.load(again.titan_states(), checkpoint_id=exported, no_dist=True)  # torchtitan's own load
    assert again.train_state.step == K and again.train_state.ntokens_seen == 6 * K
    assert train(again, range(K, N)) == expected
    assert_same(again, original)


def tune_state(j: Job, epochs_run: int) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(j.model),
        "optimizer": get_optimizer_state_dict(j.model, j.optim),
        "seed": 1234,
        "epochs_run": epochs_run,
        "total_epochs": 3,
        "max_steps_per_epoch": 2,
    }


def test_torchtune_folder_resumes_bit_for_bit_and_exports_back(cli: Cli, tmp_path: Path) -> None:
    folder, exported = tmp_path / "epoch-2", tmp_path / "exported"
    original = job(0)
    train(original, range(K))
    dcp.save(tune_state(original, 2), checkpoint_id=folder, no_dist=True)
    expected = train(original, range(K, N))

    report = json.loads(cli.ok("import", folder, "tune", "--json"))
    assert report["step"] == 2 * 2 and report["optimizer_parameters"] == 6
    assert report["extra"] == ["epochs_run", "max_steps_per_epoch", "seed", "total_epochs"]

    resumed = job(5)
    resumed.scheduler.load_state_dict(original_scheduler_at(K))
    cli.client.load("tune", model=resumed.model, optim=resumed.optim)
    assert train(resumed, range(K, N)) == expected

    cli.ok("export", "tune", exported, "--format", "dcp")
    again = job(7)
    again.scheduler.load_state_dict(original_scheduler_at(K))
    state = tune_state(again, 0)
    dcp.load(state, checkpoint_id=exported, no_dist=True)  # torchtune's own load: into its state dict
    set_model_state_dict(again.model, state["model"])
    set_optimizer_state_dict(again.model, again.optim, state["optimizer"])
    assert state["epochs_run"] == 2 and state["seed"] == 1234
    assert train(again, range(K, N)) == expected
    assert_same(again, original)


def original_scheduler_at(step: int) -> dict[str, Any]:
    """torchtune rebuilds its schedule from the step (it saves no scheduler): the same here."""
    j = job(0)
    train(j, range(step))
    return j.scheduler.state_dict()


def test_a_flattened_optimizer_naming_no_parameter_is_refused(cli: Cli, tmp_path: Path) -> None:
    original = job(0)
    train(original, range(2))
    states = original.titan_states()
    flat = states["optimizer"].state_dict()
    flat["state.gone.weight.exp_avg"] = flat["state.head.weight.exp_avg"]
    dcp.save({**states, "optimizer": flat}, checkpoint_id=tmp_path / "bad", no_dist=True)
    result = cli("import", tmp_path / "bad", "bad")
    assert result.exit_code == 2
    assert "'gone.weight.exp_avg' names no parameter of the model's state_dict" in result.stderr


def same(a: Any, b: Any) -> bool:
    """Equal trees, tensors by dtype, shape and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(2, 5),
    order=st.randoms(use_true_random=False),
    groups=st.integers(1, 3),
    kind=st.sampled_from(["adamw", "sgd"]),
)
def test_unflattening_gives_back_torchs_own_nested_state(layers: int, order: Any, groups: int, kind: str) -> None:
    """Layers of one shape, grouped and ordered at random (distinct settings per group): the flattened
    dict torch writes unflattens to exactly what ``get_optimizer_state_dict`` gives, and back."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(layers)])
    params = list(model.parameters())
    order.shuffle(params)
    cuts = sorted(order.sample(range(1, len(params)), min(groups, len(params)) - 1))
    parts = [params[a:b] for a, b in zip([0, *cuts], [*cuts, len(params)], strict=True)]
    param_groups = [{"params": part, "lr": 0.01 * (i + 1)} for i, part in enumerate(parts)]
    optim: torch.optim.Optimizer = (
        torch.optim.AdamW(param_groups) if kind == "adamw" else torch.optim.SGD(param_groups, momentum=0.9)
    )
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    flat = get_optimizer_state_dict(model, optim, options=FLAT)
    nested = get_optimizer_state_dict(model, optim)
    assert same(unflatten_optimizer(flat, list(model.state_dict()), "flat"), nested)
    assert same(flatten_optimizer(nested), flat)
