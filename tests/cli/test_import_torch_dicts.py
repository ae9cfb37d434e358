"""``ckptstore import`` of the dicts training scripts ``torch.save``: model, optimizer, scheduler,
epoch, step and metrics all kept, and training continued from the import is bitwise the training
continued from the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.client.formats.torch_dicts import name_optimizer_state, read_layout
from ckptstore.service.errors import InvalidInputError
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, batch
from tests.client.wrapping import assert_bitwise, state_by_name

LAYOUTS = [
    ("model_state_dict", "optimizer_state_dict", "scheduler_state_dict"),
    ("model", "optimizer", "scheduler"),
    ("state_dict", "optim", "lr_scheduler"),
    ("net", "optimizer", "lr_scheduler"),
]


def _save(value: object, path: Path) -> None:
    """Write the file as a user's training script does (the store itself never pickles)."""
    torch.save(value, path)  # noqa: TID251 - making the user's file under test


def _load(path: Path) -> Any:
    """Read the user's file back as their script would."""
    return torch.load(path, weights_only=True)  # noqa: TID251 - the reference resume under test


def _decay_groups(model: TinyNet) -> list[dict[str, Any]]:
    """Weight decay on matrices, none on vectors: the usual two groups, each in model order."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def _optimizer(model: TinyNet, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "sgd-groups":
        return torch.optim.SGD(_decay_groups(model), lr=1e-2, momentum=0.9)
    return torch.optim.Adam(_decay_groups(model), lr=1e-2)


def _train(model: TinyNet, optim: torch.optim.Optimizer, scheduler: Any, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        tokens, targets = batch(step)
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens), targets)
        loss.backward()
        optim.step()
        scheduler.step()
        losses.append(loss.detach())
    return losses


def _fresh(kind: str, seed: int) -> tuple[TinyNet, torch.optim.Optimizer, Any]:
    model = TinyNet(seed=seed)
    optim = _optimizer(model, kind)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


@pytest.mark.parametrize("kind", ["adamw", "sgd-groups", "adam-groups"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda keys: keys[0])
def test_a_training_checkpoint_imports_whole_and_training_continues_bitwise(
    cli: Cli, tmp_path: Path, layout: tuple[str, str, str], kind: str
) -> None:
    model_key, optim_key, scheduler_key = layout
    model, optim, scheduler = _fresh(kind, seed=1)
    _train(model, optim, scheduler, range(3))
    source = tmp_path / "ckpt.pt"
    _save(
        {
            "epoch": 3,
            model_key: model.state_dict(),
            optim_key: optim.state_dict(),
            scheduler_key: scheduler.state_dict(),
            "loss": 0.5,
            "best_acc": torch.tensor(0.75),
            "notes": {"data": "shard-3", "seeds": [1, 2]},
        },
        source,
    )
    out = cli.ok("import", source, "run")
    assert "optimizer: state of 9 parameters" in out and "scheduler" in out and "left out" not in out

    # The reference: the user's own resume from the file.
    theirs = _fresh(kind, seed=5)
    saved = _load(source)
    theirs[0].load_state_dict(saved[model_key])
    theirs[1].load_state_dict(saved[optim_key])
    theirs[2].load_state_dict(saved[scheduler_key])
    # From the store.
    ours = _fresh(kind, seed=6)
    loaded = cli.client.load("run", model=ours[0], optim=ours[1], scheduler=ours[2])
    assert loaded.extra["epoch"] == 3 and loaded.extra["loss"] == 0.5 and loaded.extra["notes"]["seeds"] == [1, 2]
    version = cli.client.versions("run")[0]
    assert version.metrics == {"loss": 0.5, "best_acc": 0.75}
    assert version.bytes_trainable > 0

    torch.manual_seed(7)  # the same dropout draws on both sides
    their_losses = _train(*theirs, range(3, 7))
    torch.manual_seed(7)
    our_losses = _train(*ours, range(3, 7))
    assert [x.item() for x in our_losses] == [x.item() for x in their_losses]
    assert_bitwise(state_by_name(ours[0], ours[1]), state_by_name(theirs[0], theirs[1]))
    assert ours[2].state_dict() == theirs[2].state_dict()
    assert ours[1].state_dict()["param_groups"] == theirs[1].state_dict()["param_groups"]


def test_the_step_and_what_is_left_out_are_reported_by_key(cli: Cli, tmp_path: Path) -> None:
    model, optim, scheduler = _fresh("adamw", seed=1)
    _train(model, optim, scheduler, range(2))
    source = tmp_path / "ckpt.pth"
    _save({"model": model.state_dict(), "global_step": 200, "classes": {3, 1}, "schedulers": [1, 2]}, source)
    out = cli.ok("import", source, "run")
    assert "step 200" in out and "left out: classes (cannot be stored" in out
    reported = json.loads(cli.ok("import", source, "run", "--json"))
    assert reported["step"] == 200 and reported["optimizer_parameters"] is None
    assert set(reported["left_out"]) == {"classes"} and reported["extra"] == ["global_step", "schedulers"]
    assert [v.step for v in cli.client.versions("run")] == [200, 200]


def test_groups_the_file_cannot_tell_apart_are_refused_and_nothing_is_stored(cli: Cli, tmp_path: Path) -> None:
    model = TinyNet(seed=1)
    first = [model.body[0].weight, model.norm.weight]  # (32, 16) and (16,)
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    # Both groups hold vectors of 16: which index is which vector is not in the file.
    optim = torch.optim.Adam([{"params": first}, {"params": rest}], lr=1e-2)
    _train(model, optim, torch.optim.lr_scheduler.StepLR(optim, 2), range(2))
    source = tmp_path / "ckpt.pt"
    _save({"model_state_dict": model.state_dict(), "optimizer_state_dict": optim.state_dict()}, source)
    failed = cli("import", source, "run")
    assert failed.exit_code == 2
    assert "['optimizer_state_dict']" in failed.stderr and "both hold parameters of shape" in failed.stderr
    assert cli.client.runs() == []


def test_two_model_keys_are_ambiguous(cli: Cli, tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    source = tmp_path / "ckpt.pt"
    _save({"model": state, "state_dict": state}, source)
    failed = cli("import", source, "run")
    assert failed.exit_code == 2 and "holds both 'state_dict' and 'model'" in failed.stderr


# The space: models of random parameter and buffer shapes, grouped at random. The mapping is
# either refused or exactly the truth; it is never a wrong guess.

SHAPES = st.sampled_from([(4,), (8,), (4, 8), (8, 4), (8, 8), (2, 4, 4)])


@st.composite
def optimizers(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[int, str]]:
    """A model state_dict, an index-keyed optimizer state_dict over it, and the true index -> name."""
    count = draw(st.integers(1, 8))
    model: dict[str, torch.Tensor] = {}
    params: list[str] = []
    for layer in range(count):
        name = f"layer{layer}.weight"
        model[name] = torch.zeros(draw(SHAPES))
        params.append(name)
        if draw(st.booleans()):
            buffer = f"layer{layer}.running_mean" if draw(st.booleans()) else f"layer{layer}.scale"
            model[buffer] = torch.zeros(draw(SHAPES))
        if draw(st.booleans()):
            model[f"layer{layer}.num_batches_tracked"] = torch.zeros((), dtype=torch.long)
    frozen = set(draw(st.lists(st.sampled_from(params), unique=True, max_size=len(params) - 1)))
    trained_params = [p for p in params if p not in frozen]
    group_of = {p: draw(st.integers(0, 2)) for p in trained_params}
    groups = [[p for p in trained_params if group_of[p] == g] for g in range(3)]
    groups = [g for g in groups if g]
    truth: dict[int, str] = {}
    param_groups = []
    for group in groups:
        indices = list(range(len(truth), len(truth) + len(group)))
        truth.update(zip(indices, group, strict=True))
        param_groups.append({"params": indices, "lr": 0.1})
    stateless = set(draw(st.lists(st.sampled_from(sorted(truth)), unique=True))) if truth else set()
    state = {
        i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(model[name].shape)}
        for i, name in truth.items()
        if i not in stateless
    }
    return model, {"state": state, "param_groups": param_groups}, truth


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optimizers())
def test_index_to_name_is_the_truth_or_refused(case: tuple[dict[str, torch.Tensor], dict[str, Any], dict]) -> None:
    model, optim, truth = case
    try:
        named = name_optimizer_state(optim, model, "ckpt.pt")
    except InvalidInputError as exc:
        assert "ckpt.pt" in str(exc)
        return
    assert named["param_groups"] == [
        {**group, "params": [truth[i] for i in group["params"]]} for group in optim["param_groups"]
    ]
    assert named["state"] == {truth[i]: s for i, s in optim["state"].items()}


def test_a_plain_model_with_buffers_and_one_group_is_never_refused() -> None:
    """The common case the rules are for: every parameter in one group, buffers named as torch names them."""
    model = TinyNet(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, torch.optim.lr_scheduler.StepLR(optim, 2), range(2))
    layout = read_layout({"model": model.state_dict(), "optimizer": optim.state_dict()}, "ckpt.pt")
    assert layout.optim is not None
    assert layout.optim["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
