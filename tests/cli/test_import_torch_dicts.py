"""``ckptstore import`` of the dicts training scripts ``torch.save``: model, optimizer, scheduler,
epoch, step and metrics all kept, and training continued from the import is bitwise the training
continued from the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.client.formats.torch_dicts import read_layout
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


def test_groups_sharing_shapes_import_by_position_and_resume_bitwise(cli: Cli, tmp_path: Path) -> None:
    """Both groups hold vectors of 16: the file cannot say which index is which vector, and
    need not: the state goes to the resuming optimizer's parameters in its groups' order."""

    def grouped(seed: int) -> tuple[TinyNet, torch.optim.Optimizer, Any]:
        model = TinyNet(seed=seed)
        first = [model.body[0].weight, model.norm.weight]  # (32, 16) and (16,)
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        optim = torch.optim.Adam([{"params": first}, {"params": rest, "lr": 5e-3}], lr=1e-2)
        return model, optim, torch.optim.lr_scheduler.StepLR(optim, 2)

    model, optim, scheduler = grouped(1)
    _train(model, optim, scheduler, range(2))
    source = tmp_path / "ckpt.pt"
    _save({"model_state_dict": model.state_dict(), "optimizer_state_dict": optim.state_dict()}, source)
    cli.ok("import", source, "run")
    ours = grouped(2)
    cli.client.load("run", model=ours[0], optim=ours[1])
    torch.manual_seed(7)
    _train(model, optim, scheduler, range(2, 4))
    torch.manual_seed(7)
    _train(ours[0], ours[1], torch.optim.lr_scheduler.StepLR(ours[1], 2), range(2, 4))
    assert_bitwise(state_by_name(ours[0], ours[1]), state_by_name(model, optim))


def test_two_model_keys_are_ambiguous(cli: Cli, tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    source = tmp_path / "ckpt.pt"
    _save({"model": state, "state_dict": state}, source)
    failed = cli("import", source, "run")
    assert failed.exit_code == 2 and "holds both 'state_dict' and 'model'" in failed.stderr


def test_a_plain_model_with_buffers_and_one_group_is_kept_by_position() -> None:
    """The common case: every parameter in one group, numbered as the optimizer numbered them."""
    model = TinyNet(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, torch.optim.lr_scheduler.StepLR(optim, 2), range(2))
    layout = read_layout({"model": model.state_dict(), "optimizer": optim.state_dict()}, "ckpt.pt")
    assert layout.optim is not None
    assert layout.optim["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))
