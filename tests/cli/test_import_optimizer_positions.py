"""An imported ``optimizer.state_dict()`` numbers its parameters; which parameter an index is, only
the optimizer that wrote it knew. The import keeps it by position and a load pairs positions with
the optimizer it is given, as ``optimizer.load_state_dict`` does: resumed training is bitwise the
original's, or the load is refused in one line. Never a mapping guessed from shapes."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptstore import client
from ckptstore.client.formats.importing import import_weights
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from tests.cli.conftest import Cli


def _save(value: object, path: Path) -> None:
    """Write the file as a user's training script does (the store itself never pickles)."""
    torch.save(value, path)  # noqa: TID251 - making the user's file under test


class HeadAndBackbone(nn.Module):
    """Two layers of one shape: nothing but the optimizer's own order tells them apart."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def head_first_adam(model: HeadAndBackbone) -> torch.optim.Optimizer:
    return torch.optim.Adam(list(model.head.parameters()) + list(model.backbone.parameters()), lr=0.05)


def step(model: nn.Module, optim: torch.optim.Optimizer, number: int) -> None:
    """One training step on a batch fixed by ``number``."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(number))
    optim.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    optim.step()


def assert_same_training(ours: nn.Module, theirs: nn.Module) -> None:
    expected = theirs.state_dict()
    unequal = [name for name, tensor in ours.state_dict().items() if not torch.equal(tensor, expected[name])]
    assert not unequal, f"resumed training differs from the original at {unequal}"


def test_head_first_adam_over_equal_shapes_resumes_bitwise(cli: Cli, tmp_path: Path) -> None:
    model = HeadAndBackbone(seed=0)
    optim = head_first_adam(model)
    for number in range(3):
        step(model, optim, number)
    source = tmp_path / "ckpt.pt"
    _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, source)
    saved_head_moment = optim.state[model.head.weight]["exp_avg"][0, 0].item()
    assert saved_head_moment != optim.state[model.backbone.weight]["exp_avg"][0, 0].item()
    cli.ok("import", source, "run")

    resumed = HeadAndBackbone(seed=1)
    resumed_optim = head_first_adam(resumed)
    cli.client.load("run", model=resumed, optim=resumed_optim)
    assert resumed_optim.state[resumed.head.weight]["exp_avg"][0, 0].item() == saved_head_moment
    for number in range(3, 6):
        step(model, optim, number)
        step(resumed, resumed_optim, number)
    assert_same_training(resumed, model)


def test_an_optimizer_grouped_otherwise_is_refused_before_anything_is_written(cli: Cli, tmp_path: Path) -> None:
    model = HeadAndBackbone(seed=0)
    optim = head_first_adam(model)
    step(model, optim, 0)
    source = tmp_path / "ckpt.pt"
    _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, source)
    cli.ok("import", source, "run")

    other = HeadAndBackbone(seed=1)
    before = {n: t.clone() for n, t in other.state_dict().items()}
    two_groups = torch.optim.Adam([{"params": other.head.parameters()}, {"params": other.backbone.parameters()}])
    with pytest.raises(StateMismatchError) as refused:
        cli.client.load("run", model=other, optim=two_groups)
    message = str(refused.value)
    assert "\n" not in message and "by position" in message and "[4]" in message and "[2, 2]" in message
    assert all(torch.equal(before[n], t) for n, t in other.state_dict().items()), "the model was written"
    assert not two_groups.state

    with pytest.raises(StateMismatchError, match="keys= cannot select"):
        cli.client.load("run", model=other, optim=head_first_adam(other), keys=["head.*"])


def test_a_dcp_export_of_state_by_position_is_refused_in_one_line(cli: Cli, tmp_path: Path) -> None:
    model = HeadAndBackbone(seed=0)
    optim = head_first_adam(model)
    step(model, optim, 0)
    source = tmp_path / "ckpt.pt"
    _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, source)
    cli.ok("import", source, "run")
    failed = cli("export", "run", tmp_path / "out", "--format", "dcp")
    assert failed.exit_code != 0
    assert failed.stderr.startswith("error: ") and failed.stderr.count("\n") == 1, failed.stderr
    assert "by position" in failed.stderr


# The space: stacks of equal-shaped layers (Linear 4x4, LayerNorm 4: their biases and weights share
# shapes), trained by an optimizer whose parameters come in any order, split into 1-3 groups, some
# left out. Resuming from the import is bitwise the original, or refused in one line.

LAYERS = st.lists(st.sampled_from(["linear", "linear", "norm"]), min_size=2, max_size=4)
KINDS = st.sampled_from(["adam", "adamw", "sgd", "rmsprop"])


@dataclass(frozen=True)
class Recipe:
    """How the user's script builds the model and its optimizer."""

    layers: tuple[str, ...]
    kind: str
    order: tuple[int, ...]  # the model's parameters, by index, in the optimizer's order
    group_of: tuple[int, ...]  # each of ``order``'s group
    left_out: int  # parameters at the end of ``order`` the optimizer does not hold

    def model(self, seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(*(nn.Linear(4, 4) if kind == "linear" else nn.LayerNorm(4) for kind in self.layers))

    def optimizer(self, model: nn.Module, *, drop_one: bool = False) -> torch.optim.Optimizer:
        params = list(model.parameters())
        held = self.order[: len(self.order) - self.left_out]
        groups: list[dict[str, Any]] = []
        for group in sorted(set(self.group_of[: len(held)])):
            members = [params[i] for i, g in zip(held, self.group_of, strict=False) if g == group]
            groups.append({"params": members, "lr": 0.01 * (group + 1)})
        if drop_one and len(held) > 1:  # a script that builds another grouping than the one that saved
            groups[-1]["params"] = groups[-1]["params"][:-1]
            if not groups[-1]["params"]:
                groups.pop()
        if self.kind == "adam":
            return torch.optim.Adam(groups)
        if self.kind == "adamw":
            return torch.optim.AdamW(groups, weight_decay=0.1)
        if self.kind == "sgd":
            return torch.optim.SGD(groups, momentum=0.9)
        return torch.optim.RMSprop(groups, momentum=0.5)


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    layers = tuple(draw(LAYERS))
    total = 2 * len(layers)  # a weight and a bias each
    order = tuple(draw(st.permutations(range(total))))
    group_of = tuple(draw(st.lists(st.integers(0, 2), min_size=total, max_size=total)))
    return Recipe(layers, draw(KINDS), order, group_of, draw(st.integers(0, 2)))


@pytest.fixture(scope="module")
def store() -> Iterator[client.Client]:
    """One embedded store for every example (each imports under a run of its own)."""
    with tempfile.TemporaryDirectory() as home, client.Client(home=home) as ckpt:
        yield ckpt


RUNS = count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recipe=recipes(), drop_one=st.booleans())
def test_every_import_resumes_bitwise_or_is_refused(store: client.Client, recipe: Recipe, drop_one: bool) -> None:
    model = recipe.model(seed=0)
    optim = recipe.optimizer(model)
    for number in range(2):
        step(model, optim, number)
    run = f"run-{next(RUNS)}"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "ckpt.pt"
        _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, source)
        try:
            import_weights(store, source, run)
        except InvalidInputError as exc:  # a refusal is an answer; a wrong mapping never is
            assert "\n" not in str(exc) and str(source) in str(exc)
            return

    resumed = recipe.model(seed=1)
    resumed_optim = recipe.optimizer(resumed, drop_one=drop_one)
    sizes = [len(g["params"]) for g in optim.param_groups]
    if [len(g["params"]) for g in resumed_optim.param_groups] != sizes:
        with pytest.raises(StateMismatchError) as refused:
            store.load(run, model=resumed, optim=resumed_optim)
        assert "\n" not in str(refused.value) and f"{sizes}" in str(refused.value)
        return
    store.load(run, model=resumed, optim=resumed_optim)
    for number in range(2, 4):
        step(model, optim, number)
        step(resumed, resumed_optim, number)
    assert_same_training(resumed, model)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_state_by_position_lands_on_each_parameters_device(cli: Cli, tmp_path: Path, fused: bool) -> None:
    """A CPU file resumed on a CUDA model: moments on the parameter's device, ``step`` on the
    host unless the saved group is fused (then on the device), the moments as saved."""
    model = HeadAndBackbone(seed=0)
    optim = torch.optim.Adam(list(model.head.parameters()) + list(model.backbone.parameters()), lr=0.05, fused=fused)
    for number in range(2):
        step(model, optim, number)
    source = tmp_path / "ckpt.pt"
    _save({"model": model.state_dict(), "optimizer": optim.state_dict()}, source)
    cli.ok("import", source, "run")

    resumed = HeadAndBackbone(seed=1).cuda()
    params = list(resumed.head.parameters()) + list(resumed.backbone.parameters())
    resumed_optim = torch.optim.Adam(params, lr=0.05, fused=fused)
    cli.client.load("run", model=resumed, optim=resumed_optim)
    for param in params:
        state = resumed_optim.state[param]
        assert state["exp_avg"].device == param.device and state["exp_avg_sq"].device == param.device
        assert state["step"].device == (param.device if fused else torch.device("cpu"))
    original = resumed_optim.state[resumed.head.weight]["exp_avg"].cpu()
    assert torch.equal(original, optim.state[model.head.weight]["exp_avg"])
