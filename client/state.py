"""Flattening a model, an optimizer, a scheduler and user extras into keyed tensors + JSON.

Every tensor becomes a :class:`TensorRecord` with its manifest key and placement; every
other value goes into a JSON tree that refers to tensors by key. Optimizer state is keyed by
the **parameter's name** in the model, so it loads into a freshly built optimizer whatever
order its parameters were passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from client import jsonstate, keys, names
from client.placement import group_places_step_on_device
from client.tensors import check_storable
from service.errors import StateEncodingError, StateMismatchError
from service.format.manifest import Placement


@dataclass(slots=True)
class TensorRecord:
    """One tensor to store: its key, the tensor, and how load must place it."""

    key: str
    tensor: torch.Tensor
    placement: Placement
    param: str | None = None
    trainable: bool | None = None


@dataclass
class FlatState:
    """Everything a save stores: tensors by key and the JSON sections referring to them."""

    records: list[TensorRecord] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    _keys: set[str] = field(default_factory=set)

    def add(self, record: TensorRecord) -> str:
        """Add a record, refusing a key twice or a tensor the format cannot hold; returns the key."""
        if record.key in self._keys:
            raise StateEncodingError(f"two tensors map to the key {record.key!r}")
        check_storable(record.tensor, record.key)
        self._keys.add(record.key)
        self.records.append(record)
        return record.key


def parameter_names(model: torch.nn.Module, known: names.ModelNames | None = None) -> dict[int, str]:
    """``id(parameter) -> canonical name`` for every parameter of ``model`` (first name for tied
    ones), from ``known`` names of it when given."""
    parameters = known.parameters if known is not None else names.parameters(model)
    return {id(p): name for name, p in parameters.items()}


def _host_or_target(tensor: torch.Tensor) -> Placement:
    return "host" if tensor.device.type == "cpu" else "target"


def flatten_model(flat: FlatState, model: torch.nn.Module, known: names.ModelNames | None = None) -> None:
    """Add every tensor of ``model.state_dict()`` under ``model/<canonical name>``
    (:mod:`client.names`), from ``known`` names of it when given."""
    if known is None:
        known = names.ModelNames(names.state_dict(model), {})
    for (name, value), key in zip(known.state_dict.items(), known.model_keys, strict=True):
        if not isinstance(value, torch.Tensor):
            raise StateEncodingError(
                f"model/{name}: the model's state_dict holds a {type(value).__name__}, not a tensor "
                "(custom extra state); save it through extra= instead"
            )
        flat.add(TensorRecord(key, value, "target", trainable=bool(value.requires_grad)))


def _optimizer_param_names(optim: torch.optim.Optimizer, param_names: dict[int, str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for group_index, group in enumerate(optim.param_groups):
        group_names = []
        for param in group["params"]:
            name = param_names.get(id(param))
            if name is None:
                raise StateMismatchError(
                    f"optimizer param group {group_index} holds a parameter of shape {tuple(param.shape)} "
                    "that is not a parameter of the model passed to save(); optimizer state is keyed by "
                    "parameter name, so pass the model that owns every optimized parameter"
                )
            group_names.append(name)
        groups.append(group_names)
    return groups


def flatten_optimizer(
    flat: FlatState, optim: torch.optim.Optimizer, model: torch.nn.Module, known: names.ModelNames | None = None
) -> None:
    """Add optimizer state keyed by parameter name, plus any tensors inside param_groups."""
    group_names = _optimizer_param_names(optim, parameter_names(model, known))
    saved = optim.state_dict()
    index_names = [name for group_params in group_names for name in group_params]
    state = {index_names[index]: param_state for index, param_state in saved["state"].items()}
    groups = [{**group, "params": names} for group, names in zip(saved["param_groups"], group_names, strict=True)]
    flatten_named_optimizer(flat, state, groups)


def flatten_named_optimizer(flat: FlatState, state: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Add an optimizer state_dict keyed by parameter name (``state`` by name, each group's
    ``params`` a list of names: the layout ``get_state_dict`` gives), placing Adam's ``step``
    on the host unless its group is fused or capturable."""
    group_of = {name: g for g, group in enumerate(param_groups) for name in group["params"]}
    step_on_host = [not group_places_step_on_device(group) for group in param_groups]
    state_json: dict[str, Any] = {}
    for name, param_state in state.items():
        if name not in group_of:
            raise StateEncodingError(f"optimizer state for {name!r}, which no param group lists")
        prefix = keys.join("optim", "state", name)
        host_step = f"{prefix}/step" if step_on_host[group_of[name]] else None

        def store(tensor: torch.Tensor, path: str, name: str = name, host_step: str | None = host_step) -> str:
            if path == host_step:
                return flat.add(TensorRecord(path, tensor, "host"))
            return flat.add(TensorRecord(path, tensor, "param", name))

        state_json[name] = jsonstate.encode(param_state, prefix, store)
    groups_json = []
    for group_index, group in enumerate(param_groups):
        group_params = list(group["params"])
        owner = group_params[0] if group_params else None

        def store_group(tensor: torch.Tensor, path: str, owner: str | None = owner) -> str:
            if owner is None:
                return flat.add(TensorRecord(path, tensor, "target"))
            return flat.add(TensorRecord(path, tensor, "param", owner))

        hyper = {k: v for k, v in group.items() if k != "params"}
        encoded = jsonstate.encode(hyper, keys.join("optim", "param_groups", group_index), store_group)
        encoded["params"] = group_params
        groups_json.append(encoded)
    flat.state["optim"] = {"state": state_json, "param_groups": groups_json}


def flatten_other(flat: FlatState, section: str, value: Any) -> None:
    """Add a scheduler's state_dict or user extras under ``section``."""

    def store(tensor: torch.Tensor, path: str) -> str:
        return flat.add(TensorRecord(path, tensor, _host_or_target(tensor)))

    flat.state[section] = jsonstate.encode(value, section, store)


def flatten_extra(flat: FlatState, extra: Any) -> None:
    """Add user extras (a dict of JSON values and tensors) under ``extra``."""
    if not isinstance(extra, dict):
        raise StateEncodingError(f"extra must be a dict, not {type(extra).__name__}")
    flatten_other(flat, "extra", extra)


def flatten(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    names_of: Callable[[torch.nn.Module], names.ModelNames] = names.model_names,
) -> FlatState:
    """Flatten everything a save stores; ``names_of`` gives the model's names (a client passes
    its :class:`client.names.NamesCache`)."""
    if not isinstance(model, torch.nn.Module):
        raise StateEncodingError(
            f"model must be a torch.nn.Module, not a {type(model).__name__}; "
            "store a plain {name: tensor} dict with save_state_dict"
        )
    flat = FlatState()
    known = names_of(model)
    flatten_model(flat, model, known)
    if optim is not None:
        flatten_optimizer(flat, optim, model, known)
    if scheduler is not None:
        flatten_other(flat, "scheduler", scheduler.state_dict())
    if extra is not None:
        flatten_extra(flat, extra)
    return flat
