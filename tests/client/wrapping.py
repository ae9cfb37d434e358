"""Wrapped models and bitwise comparisons under canonical names, for the wrapper tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from ckptstore.client import names
from tests.client.models import TinyNet, tensors_equal, train

Wrap = Callable[[nn.Module], nn.Module]


def compiled(model: nn.Module) -> nn.Module:
    """torch.compile's wrapper (nothing compiles until it is called)."""
    return torch.compile(model)


def checkpointed(model: nn.Module) -> nn.Module:
    """Activation checkpointing around each Linear, in place (the wrappers sit inside ``model``)."""
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    return model


WRAPS: dict[str, Wrap] = {
    "plain": lambda m: m,
    "compile": compiled,
    "checkpoint": checkpointed,
    "compile(checkpoint)": lambda m: compiled(checkpointed(m)),
}


def trained() -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(3))
    return model, optim


def state_by_name(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model tensor and optimizer state tensor under canonical names."""
    found = {f"model/{n}": t.detach() for n, t in names.state_dict(model).items()}
    by_id = {id(p): n for n, p in names.parameters(model).items()}
    for param, state in optim.state.items():
        for key, value in state.items():
            found[f"optim/{by_id[id(param)]}/{key}"] = value
    return found


def assert_bitwise(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    unequal = [k for k in expected if not tensors_equal(found[k], expected[k])]
    assert not unequal, unequal
