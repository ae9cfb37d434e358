"""``ckptstore import`` stores a wrapped model's names as ``client.save`` does: without the parts
torch.compile (``_orig_mod``) and DDP (``module``) add, so a plain model loads the version or
its export strictly, and ``client.load()`` without a model gives the plain names back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckptstore.client.formats.wrapped_names import canonical_model, canonical_rule
from ckptstore.service.errors import InvalidInputError
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, train
from tests.client.wrapping import assert_bitwise, state_by_name


def _save(value: object, path: Path) -> None:
    """Write the file as a user's training script does (the store itself never pickles)."""
    torch.save(value, path)  # noqa: TID251 - making the user's file under test


def _prefixed(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {prefix + name: value for name, value in state.items()}


def _plain_names() -> list[str]:
    return list(TinyNet().state_dict())


def test_a_compiled_models_state_dict_imports_under_the_plain_names(cli: Cli, tmp_path: Path) -> None:
    model = TinyNet(seed=3)
    compiled = torch.compile(model)  # lazy: its state_dict names _orig_mod without compiling anything
    raw = compiled.state_dict()
    assert all(name.startswith("_orig_mod.") for name in raw)
    source = tmp_path / "compiled.pt"
    _save(raw, source)
    cli.ok("import", source, "run")

    loaded = cli.client.load("run")
    assert loaded.state_dict is not None and list(loaded.state_dict) == _plain_names()

    cli.ok("export", "run", tmp_path / "hf")
    plain = TinyNet(seed=4)
    plain.load_state_dict(load_file(tmp_path / "hf" / "model.safetensors"), strict=True)
    assert all(torch.equal(plain.state_dict()[n], t) for n, t in model.state_dict().items())


@pytest.mark.parametrize("prefix", ["module.", "module._orig_mod.", "_orig_mod.module."])
def test_a_ddp_training_checkpoint_imports_under_plain_names_and_resumes(cli: Cli, tmp_path: Path, prefix: str) -> None:
    """DDP's ``module.`` (and DDP with compile, either way round) on the model's keys and on the
    names of an optimizer state saved by name."""
    model = TinyNet(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    saved = optim.state_dict()
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {prefix + names[index]: state for index, state in saved["state"].items()},
        "param_groups": [
            {**group, "params": [prefix + names[i] for i in group["params"]]} for group in saved["param_groups"]
        ],
    }
    source = tmp_path / "ddp.pt"
    _save({"model": _prefixed(model.state_dict(), prefix), "optimizer": by_name, "epoch": 2}, source)
    cli.ok("import", source, "run")

    manifest = cli.client.transport.manifest("run", "latest")
    assert [e.key for e in manifest.tensors if e.key.startswith("model/")] == [f"model/{n}" for n in _plain_names()]
    assert sorted(manifest.state["optim"]["state"]) == sorted(names)
    resumed = TinyNet(seed=2)
    resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    cli.client.load("run", model=resumed, optim=resumed_optim)
    torch.manual_seed(7)  # the same dropout draws on both sides
    train(model, optim, range(2, 4))
    torch.manual_seed(7)
    train(resumed, resumed_optim, range(2, 4))
    assert_bitwise(state_by_name(resumed, resumed_optim), state_by_name(model, optim))


def test_a_submodule_called_module_keeps_its_name(cli: Cli, tmp_path: Path) -> None:
    """Only a ``module.`` every name starts with is DDP's; here it is the user's own submodule,
    inside a compiled model."""

    class Owner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.head = torch.nn.Linear(2, 1)

    raw = torch.compile(Owner()).state_dict()
    assert sorted(raw) == [f"_orig_mod.{n}" for n in ("head.bias", "head.weight", "module.bias", "module.weight")]
    source = tmp_path / "own.pt"
    _save(raw, source)
    cli.ok("import", source, "run")
    loaded = cli.client.load("run")
    assert loaded.state_dict is not None and list(loaded.state_dict) == list(Owner().state_dict())


def test_two_names_that_unwrap_to_one_are_refused_naming_both(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "both.pt"
    _save({"fc._orig_mod.weight": torch.ones(2), "fc.weight": torch.zeros(2)}, source)
    failed = cli("import", source, "run")
    assert failed.exit_code == 2 and failed.stderr.count("\n") == 1
    assert "'fc._orig_mod.weight' and 'fc.weight' both name 'fc.weight'" in failed.stderr
    assert cli.client.runs() == []


# The space: plain names (some with a submodule of the user's called ``module``), wrapped as
# compile, DDP and activation checkpointing wrap them, come back as they were.

PARTS = st.sampled_from(["fc", "0", "1", "layers", "module", "norm", "weight", "bias", "attn"])
NAMES = st.lists(st.lists(PARTS, min_size=1, max_size=4).map(".".join), min_size=1, max_size=8, unique=True)
WRAPPINGS = st.sampled_from(["", "_orig_mod.", "module.", "module._orig_mod.", "_orig_mod.module."])


@settings(max_examples=300, deadline=None)
@given(names=NAMES, outer=WRAPPINGS, checkpointed=st.data())
def test_wrapped_names_unwrap_to_the_plain_ones(names: list[str], outer: str, checkpointed: st.DataObject) -> None:
    if all(name.startswith("module.") for name in names):  # a user's model whose one child is `module`
        names = [*names, "head.weight"]
    wrapped = []
    for name in names:
        parts = name.split(".")
        inside = checkpointed.draw(st.integers(0, len(parts) - 1))  # a wrapped submodule along the path
        if checkpointed.draw(st.booleans()):
            parts.insert(inside, "_checkpoint_wrapped_module")
        wrapped.append(outer + ".".join(parts))
    state = dict.fromkeys(wrapped, 0)
    assert list(canonical_model(state, canonical_rule(state), "ckpt.pt")) == names
    assert list(canonical_model(dict.fromkeys(names, 0), canonical_rule(names), "ckpt.pt")) == names


def test_a_wrapped_name_beside_its_plain_one_is_refused() -> None:
    state = {"_orig_mod.fc.weight": 0, "fc.weight": 1}
    with pytest.raises(InvalidInputError, match="both name 'fc.weight'"):
        canonical_model(state, canonical_rule(state), "ckpt.pt")
