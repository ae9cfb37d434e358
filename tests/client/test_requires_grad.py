"""A parameter's ``requires_grad`` is recorded with the version (the manifest's ``requires_grad``) and
given back: a frozen parameter comes back frozen in a fresh model, a load without a model returns
tensors with their flag, and a ``.pt`` of Parameters keeps theirs through ``ckptstore import``.
Versions that did not record it (older ones, state_dict files, whose tensors carry no flag) leave
the model's own flags alone."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import client
from ckptstore.client import SaveHandle
from ckptstore.client.formats.importing import import_weights, read_checkpoint
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.manifest import TensorEntry, manifest_from_json, manifest_to_json
from tests.cli.hostile_pickles import torch_saved


def net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def flags(model: torch.nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


FROZEN_FIRST = {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True, "2.weight": True, "2.bias": True}


def frozen_first(model: torch.nn.Sequential) -> torch.nn.Sequential:
    for param in model[0].parameters():
        param.requires_grad_(False)
    return model


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_frozen_parameter_comes_back_frozen_in_a_fresh_model(tmp_path: Path, background: str) -> None:
    with client.Client(home=tmp_path / "home", background=background) as ckpt:
        handle = ckpt.save("run", frozen_first(net(0)), blocking=False)  # through the save process, if any
        assert isinstance(handle, SaveHandle) and handle.result().version == 1
        entries = {e.key: e for e in ckpt.transport.manifest("run", "latest").tensors}
        assert entries["model/0.weight"].requires_grad is False and entries["model/2.bias"].requires_grad is True
        assert entries["model/1.running_mean"].requires_grad is None  # a buffer: no flag to record

        fresh = net(1)
        fresh[2].weight.requires_grad_(False)  # the version says trainable: it becomes so again
        assert flags(fresh) != FROZEN_FIRST
        ckpt.load("run", model=fresh)
        assert flags(fresh) == FROZEN_FIRST

        tensors = ckpt.load("run").state_dict
        assert tensors is not None
        assert {
            name: t.requires_grad for name, t in tensors.items() if "running" not in name and "batches" not in name
        } == (FROZEN_FIRST)
        assert not tensors["1.running_mean"].requires_grad


def test_a_version_that_records_no_flag_leaves_the_models_own(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "home") as ckpt:
        ckpt.save_state_dict("plain", {k: v.detach() for k, v in net(0).state_dict().items()})
        assert all(e.requires_grad is None for e in ckpt.transport.manifest("plain", 1).tensors)
        fresh = frozen_first(net(1))
        ckpt.load("plain", model=fresh)
        assert flags(fresh) == FROZEN_FIRST


def test_a_manifest_written_before_the_flag_still_reads() -> None:
    entry = {
        "key": "model/w", "dtype": "F32", "shape": [2], "dtype_class": "floating", "digest": "0" * 64,
        "placement": "target", "device_type": "cpu", "trainable": True,
    }  # fmt: skip
    assert TensorEntry.model_validate(entry).requires_grad is None
    assert "requires_grad" not in TensorEntry.model_validate(entry).model_dump(exclude_none=True)
    with pytest.raises(ValueError, match="'requires_grad' is for model tensors only"):
        TensorEntry.model_validate({**entry, "key": "extra/w", "trainable": None, "requires_grad": True})


def test_a_manifest_with_the_flag_round_trips_as_json(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "home") as ckpt:
        ckpt.save("run", frozen_first(net(0)))
        manifest = ckpt.transport.manifest("run", 1)
    text = manifest_to_json(manifest)
    assert '"requires_grad":false' in text
    assert manifest_from_json(text) == manifest
    assert json.loads(text)["tensors"][0]["requires_grad"] is False


def test_an_imported_pt_of_parameters_keeps_their_flags(tmp_path: Path) -> None:
    model = frozen_first(net(0))
    params = torch_saved(dict(model.named_parameters()), tmp_path / "params.pt")
    plain = torch_saved(model.state_dict(), tmp_path / "state_dict.pt")
    with client.Client(home=tmp_path / "home") as ckpt:
        import_weights(ckpt, params, "params")
        import_weights(ckpt, plain, "plain")
        recorded = {e.key.removeprefix("model/"): e.requires_grad for e in ckpt.transport.manifest("params", 1).tensors}
        assert recorded == FROZEN_FIRST
        assert all(e.requires_grad is None for e in ckpt.transport.manifest("plain", 1).tensors)

        fresh = net(1)
        for param in fresh.parameters():
            param.requires_grad_(False)
        ckpt.load("params", model=fresh, strict=False)  # the file holds the parameters only
        assert flags(fresh) == FROZEN_FIRST


class ParameterOf:
    """Pickles as ``torch._utils._rebuild_parameter(tensor, requires_grad, {})``, however the tensor is."""

    def __init__(self, tensor: torch.Tensor, requires_grad: Any) -> None:
        self.args = (tensor, requires_grad, OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return torch._utils._rebuild_parameter, self.args


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (ParameterOf(torch.arange(4), True), "requires grad, which only floating tensors can"),
        (ParameterOf(torch.zeros(2), "yes"), "no requires_grad flag"),
        (ParameterOf([1, 2], False), "holds no tensor"),
    ],
    ids=["integer-requiring-grad", "flag-not-a-bool", "not-a-tensor"],
)
def test_hostile_parameters_are_refused(tmp_path: Path, value: Any, refusal: str) -> None:
    path = torch_saved({"w": value, "b": torch.zeros(2)}, tmp_path / "hostile.pt")
    with pytest.raises(InvalidInputError, match=refusal):
        read_checkpoint(path)
