"""Canonical names across wrappers: torch.compile's OptimizedModule, activation checkpointing's
CheckpointWrapper, nested in either order; saved wrapped, loaded plain and the reverse, bitwise,
optimizer state included; older versions holding wrapped names still load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ckptstore import client
from ckptstore.client import names
from ckptstore.service.errors import StateMismatchError
from tests.client.models import TinyNet, tensors_equal
from tests.client.wrapping import WRAPS, assert_bitwise, checkpointed, compiled, state_by_name, trained


@pytest.fixture
def ckpt(tmp_path: Path) -> client.Client:
    with client.Client(home=tmp_path / "store") as embedded:
        yield embedded


def test_wrapped_names_are_found_by_walking_the_modules() -> None:
    model = TinyNet()
    assert names.wrapper_paths(model) == frozenset()
    wrapped = compiled(checkpointed(model))
    raw = set(dict(wrapped.named_parameters()))
    assert "_orig_mod.body.0._checkpoint_wrapped_module.weight" in raw
    assert set(names.parameters(wrapped)) == set(dict(TinyNet().named_parameters()))
    assert list(names.state_dict(wrapped)) == list(TinyNet().state_dict())


def test_a_users_own_submodule_called_module_keeps_its_name() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)  # not a wrapper: the name is the user's
            self._orig_mod = nn.Linear(2, 2)

    wrapped = compiled(Holder())
    assert sorted(names.state_dict(wrapped)) == ["_orig_mod.bias", "_orig_mod.weight", "module.bias", "module.weight"]


@pytest.mark.parametrize("saved_as", list(WRAPS))
@pytest.mark.parametrize("loaded_as", list(WRAPS))
def test_any_wrapping_loads_strictly_into_any_other(ckpt: client.Client, saved_as: str, loaded_as: str) -> None:
    model, optim = trained()
    expected = state_by_name(model, optim)
    ckpt.save("wrapped", WRAPS[saved_as](model), optim, step=3)
    stored = {e.key for e in ckpt.transport.manifest("wrapped", "latest").tensors if e.key.startswith("model/")}
    assert stored == {f"model/{n}" for n in TinyNet().state_dict()}

    fresh = TinyNet(seed=7)
    target = WRAPS[loaded_as](fresh)
    fresh_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
    assert not tensors_equal(fresh.body[0].weight, model.body[0].weight)
    result = ckpt.load("wrapped", model=target, optim=fresh_optim)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_bitwise(state_by_name(target, fresh_optim), expected)


def test_versions_saved_with_wrapped_names_still_load(ckpt: client.Client) -> None:
    """Before names were canonical a compiled model's save stored ``_orig_mod.…`` for its
    tensors and its optimizer state. A module holding the model under that very attribute
    (not a wrapper, so its names are kept) writes exactly such a version."""

    class Legacy(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    model, optim = trained()
    expected = state_by_name(model, optim)
    ckpt.save("legacy", Legacy(model), optim)
    stored = {e.key for e in ckpt.transport.manifest("legacy", 1).tensors}
    assert "model/_orig_mod.embed.weight" in stored and "optim/state/_orig_mod.embed.weight/exp_avg" in stored

    for wrap in ("plain", "compile(checkpoint)"):
        fresh = TinyNet(seed=9)
        target = WRAPS[wrap](fresh)
        fresh_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
        ckpt.load("legacy", model=target, optim=fresh_optim)
        assert_bitwise(state_by_name(target, fresh_optim), expected)


def test_a_genuinely_different_model_still_fails_strictly(ckpt: client.Client) -> None:
    model, optim = trained()
    ckpt.save("net", compiled(model), optim)

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

    with pytest.raises(StateMismatchError, match="missing keys .*layer.weight.*unexpected keys .*embed.weight"):
        ckpt.load("net", model=compiled(Other()))
