"""The dicts training scripts ``torch.save``, understood: model, optimizer, scheduler, counters, metrics.

A tutorial checkpoint is ``{"epoch": 3, "model_state_dict": ..., "optimizer_state_dict": ...,
"loss": 0.5}``; others say ``model``/``optimizer``/``scheduler``, ``state_dict``/``optim``/
``lr_scheduler``, ``net``, ``global_step``. :func:`read_layout` finds each part by those names
and keeps the rest:

- the model's tensors (the one dict of tensors under a model key, or the file itself);
- the optimizer's state: by parameter name where the file names them, else by position
  (:func:`optimizer_state`: a numbered state_dict says nothing of which parameter each index
  is), so ``client.load(..., optim=...)`` restores it into the optimizer it is given as
  ``optimizer.load_state_dict`` would; its parameters are then stored as trainable;
- the scheduler's state; ``global_step``/``step`` as the version's step;
- every other key in ``extra`` (``epoch`` and ``loss`` included: ``LoadResult.extra`` gives the
  dict back as saved), numbers under metric-like names also as the version's metrics;
- a value that cannot be stored (a ``set``, a string-keyed dict of odd keys jsonstate refuses)
  is left out and reported by key, never dropped silently.

The value was measured by the pickle reader (bounded size and depth), but an attacker still
chooses its shape: every pass here is linear (no ``x in list`` inside a loop, no pair of groups
compared with every other), and a key is named by :func:`~client.formats.pickled.allowlist.shown`,
never formatted whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.client import jsonstate, keys
from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.client.formats.torch_save.constructors import RefusedTensor
from ckptstore.client.tensors import check_storable
from ckptstore.service.errors import InvalidInputError, StateEncodingError
from ckptstore.service.format.names import METRIC_PATTERN

MODEL_KEYS = ("model_state_dict", "state_dict", "model", "net")
OPTIMIZER_KEYS = ("optimizer_state_dict", "optimizer", "optim")
SCHEDULER_KEYS = ("scheduler_state_dict", "lr_scheduler", "scheduler")
STEP_KEYS = ("global_step", "step")
_METRIC_RE = re.compile(METRIC_PATTERN)
_NONE = object()  # what next() gives when nothing is found (None may be a key)


@dataclass
class Layout:
    """The parts of a ``torch.save`` dict (see the module docstring)."""

    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None = None
    scheduler: Any = None
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)


def tensor_dict(value: Any, where: str) -> dict[str, torch.Tensor]:
    """``value`` as a non-empty dict of tensors by name, or a refusal naming what is wrong."""
    if not isinstance(value, dict) or not value:
        raise InvalidInputError(f"{where} is not a non-empty dict of tensors")
    for key, tensor in value.items():
        if isinstance(tensor, RefusedTensor):
            raise InvalidInputError(f"{where}: tensor {shown(key, 80)} {tensor.reason}")
    bad = [shown(k, 80) for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)][:5]
    if bad:
        raise InvalidInputError(f"{where} holds entries that are not tensors under names: [{', '.join(bad)}]")
    return value


def _is_tensor_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(v, (torch.Tensor, RefusedTensor)) for v in value.values())
    )


def _one_of(loaded: dict[Any, Any], keys: Sequence[str], what: str, where: str) -> str | None:
    """The one key of ``keys`` present in ``loaded`` (None if none); two present is ambiguous."""
    present = [k for k in keys if k in loaded]
    if len(present) > 1:
        raise InvalidInputError(
            f"{where} holds both {present[0]!r} and {present[1]!r}: which is the {what} is ambiguous; "
            "save one of them under its own file"
        )
    return present[0] if present else None


def read_layout(loaded: Any, where: str) -> Layout:
    """The parts of an object read from a ``torch.save`` file (a state_dict, or a dict holding one)."""
    if _is_tensor_dict(loaded):
        return Layout(tensor_dict(loaded, where))
    if not isinstance(loaded, dict):
        raise InvalidInputError(f"{where} holds a {type(loaded).__name__}, not a state_dict")
    model_key = _one_of(loaded, MODEL_KEYS, "model", where)
    if model_key is None:
        named = [shown(k) for _, k in zip(range(10), loaded, strict=False)]
        raise InvalidInputError(
            f"{where} holds a dict with keys [{', '.join(named)}], none of which is a state_dict {MODEL_KEYS}"
        )
    layout = Layout(tensor_dict(loaded[model_key], f"{where}[{model_key!r}]"))
    optim_key = _one_of(loaded, OPTIMIZER_KEYS, "optimizer", where)
    if optim_key is not None:
        layout.optim = optimizer_state(loaded[optim_key], layout.model, f"{where}[{optim_key!r}]")
    scheduler_key = _one_of(loaded, SCHEDULER_KEYS, "scheduler", where)
    if scheduler_key is not None:
        scheduler = loaded[scheduler_key]
        if isinstance(scheduler, dict):
            layout.scheduler = scheduler
        else:
            layout.left_out[scheduler_key] = f"a {type(scheduler).__name__}, not one scheduler's state_dict"
    step_key = _one_of(loaded, STEP_KEYS, "step", where)
    if step_key is not None and type(loaded[step_key]) is int and loaded[step_key] >= 0:
        layout.step = loaded[step_key]
    taken = {model_key, optim_key, scheduler_key}
    for key, value in loaded.items():
        if key in taken:
            continue
        if not isinstance(key, str):
            layout.left_out[shown(key, 80)] = "a key that is not a string"
            continue
        why = unstorable(key, value)
        if why is not None:
            layout.left_out[key] = f"cannot be stored: {why}"
            continue
        layout.extra[key] = value
        metric = _metric_value(value)
        if key not in STEP_KEYS and key != "epoch" and metric is not None and _METRIC_RE.fullmatch(key):
            layout.metrics[key] = metric
    return layout


def _metric_value(value: Any) -> float | None:
    """A finite number (or a one-element floating tensor) as a float; None for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def unstorable(key: Any, value: Any) -> str | None:
    """Why ``value`` (a checkpoint's ``key``) cannot go into a version's extras, in one line; None if it can.

    Tensors are checked as a save checks them (:func:`client.tensors.check_storable`), and one the
    reader could not make over its bytes is named by its path.
    """
    if not isinstance(key, str):
        return f"its key is a {type(key).__name__}, not a string"
    refused = _refused_tensor(value, keys.escape(key))
    if refused is not None:
        return refused

    def check(tensor: torch.Tensor, path: str) -> str:
        check_storable(tensor, path)
        return path

    try:
        jsonstate.encode(value, keys.escape(key), check)
    except StateEncodingError as exc:
        return str(exc).split("; ")[0]
    return None


def _refused_tensor(value: Any, where: str) -> str | None:
    """Why a tensor in ``value`` could not be made over its bytes (the first one met), naming its path.

    ``value`` was measured by the pickle reader (bounded size and depth), so this walk is too; the
    path is spelled only for the tensor found (each node keeps its parent and its key, never a path:
    a long key shared by a million dicts is not copied a million times).
    """
    steps: list[tuple[int, Any]] = [(-1, None)]  # (parent step, key or index)
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, step = stack.pop()
        if isinstance(node, RefusedTensor):
            return f"{_path(where, steps, step)}: a tensor that {node.reason}"
        children = (
            node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
        )
        for part, child in children:
            if isinstance(child, (dict, list, tuple, RefusedTensor)):
                steps.append((step, part))
                stack.append((child, len(steps) - 1))
    return None


def _path(where: str, steps: list[tuple[int, Any]], step: int) -> str:
    """``where`` and the escaped keys from the root to ``steps[step]``, each cut short."""
    parts: list[str] = []
    while step > 0:
        step, part = steps[step]
        parts.append(keys.escape(part[:80] if isinstance(part, str) else part if type(part) is int else shown(part)))
    return "/".join([where, *reversed(parts)])


def optimizer_state(state: Any, model: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    """An optimizer state_dict as an import stores it: by name where the file names the
    parameters (every name checked against the model), else by position.

    ``Optimizer.state_dict()`` numbers the parameters in its groups' order; which parameter an
    index is, only the optimizer that made the file knew (two parameters of one shape look
    alike, and groups need not follow the model's order). So numbered state is never mapped
    onto names: it is kept by position, renumbered 0, 1, ... in the groups' order (how
    ``Optimizer.load_state_dict`` pairs saved indices with parameters), and a load resolves the
    positions against the optimizer it is given. Its structure is checked here: every group's
    ``params`` a list of distinct indices, every state a dict held by a group.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    by_index = state.get("state") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(by_index, dict) or not all(isinstance(g, dict) for g in groups):
        raise InvalidInputError(f"{where}: not an optimizer state_dict (a dict with 'state' and a 'param_groups' list)")
    if not all(isinstance(s, dict) for s in by_index.values()):
        raise InvalidInputError(f"{where}: a parameter's state is not a dict")
    params = [g.get("params") for g in groups]
    if all(isinstance(p, list) and all(isinstance(n, str) for n in p) for p in params):
        return _checked_by_name(state, model, where)
    if not all(isinstance(p, list) and all(type(i) is int for i in p) for p in params):
        raise InvalidInputError(f"{where}: a param group's 'params' is not a list of indices or of names")
    position: dict[int, int] = {}
    for index in (i for p in params for i in p):
        if index in position:
            raise InvalidInputError(f"{where}: parameter index {shown(index)} appears twice in the param groups")
        position[index] = len(position)
    unknown = next((i for i in by_index if i not in position), _NONE)
    if unknown is not _NONE:
        raise InvalidInputError(f"{where}: state for parameter index {shown(unknown)}, which no param group holds")
    return {
        "state": {position[i]: s for i, s in by_index.items()},
        "param_groups": [{**g, "params": [position[i] for i in g["params"]]} for g in groups],
    }


def _checked_by_name(state: dict[str, Any], model: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    """An optimizer state_dict already keyed by name: every name must be a tensor of the model."""
    named = [n for g in state["param_groups"] for n in g["params"]]
    absent = next((n for n in named if n not in model), None)
    if absent is not None:
        raise InvalidInputError(f"{where}: parameter {shown(absent, 80)} is not in the model's state_dict")
    held = set(named)
    if len(held) != len(named):
        raise InvalidInputError(f"{where}: a parameter name appears twice in the param groups")
    stray = next((k for k in state["state"] if k not in held), _NONE)
    if stray is not _NONE:
        raise InvalidInputError(f"{where}: state for {shown(stray, 80)}, which no param group holds")
    return {"state": dict(state["state"]), "param_groups": list(state["param_groups"])}
