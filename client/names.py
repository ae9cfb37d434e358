"""Canonical tensor names: a model's state_dict and parameter names as the unwrapped model has them.

``torch.compile`` stores the model as ``_orig_mod``, DDP and DataParallel as ``module``, FSDP1
as ``_fsdp_wrapped_module`` and activation checkpointing as ``_checkpoint_wrapped_module``, so
the same weight is ``module._orig_mod.0.weight`` in one process and ``0.weight`` in the next.
Saves store the canonical name (the fully qualified name
``torch.distributed.checkpoint.state_dict.get_state_dict`` reports) and loads map it back onto
whatever wrapping the target has.

The wrappers are found by walking the model's modules, not by string matching: only the part
that names a wrapper's own child is dropped, so a user's submodule called ``module`` keeps its
name. A wrapper class is looked up only when its module is already imported (a model cannot
hold an ``OptimizedModule`` unless ``torch._dynamo`` was imported), which keeps this free.

Versions stored before names were canonical may hold wrapped names; :func:`match_names` maps
them onto the target's canonical names when that is unambiguous.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from client import keys
from service.errors import StateEncodingError

#: (module, class, the attribute holding the wrapped model) of every wrapper whose part is dropped.
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
)
#: Every name part a wrapper adds.
WRAPPER_PARTS = frozenset(attribute for _, _, attribute in _WRAPPERS)


def _loaded_wrappers() -> tuple[tuple[type, ...], dict[type, str]]:
    """The wrapper classes whose modules are imported, and the attribute each holds its model in."""
    found: dict[type, str] = {}
    for home, class_name, attribute in _WRAPPERS:
        loaded = sys.modules.get(home)
        cls = getattr(loaded, class_name, None) if loaded is not None else None
        if isinstance(cls, type):
            found[cls] = attribute
    return tuple(found), found


def wrapper_paths(model: torch.nn.Module) -> frozenset[str]:
    """The raw module paths that are a wrapper's wrapped child, e.g. ``{"module", "module._orig_mod"}``."""
    classes, attributes = _loaded_wrappers()
    if not classes:
        return frozenset()
    paths = set()
    # One isinstance against every loaded wrapper class a module: a save walks every module.
    module: torch.nn.Module
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, classes):
            attribute = next(a for cls, a in attributes.items() if isinstance(module, cls))
            if attribute in module._modules:
                paths.add(f"{prefix}.{attribute}" if prefix else attribute)
    return frozenset(paths)


class Canonical:
    """Maps a model's raw names (state_dict keys, parameter names) to canonical ones."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.paths = wrapper_paths(model)

    def __call__(self, name: str) -> str:
        """The canonical form of ``name``: every part naming a wrapper's child dropped."""
        if not self.paths:
            return name
        kept = []
        raw = ""
        for part in name.split("."):
            raw = f"{raw}.{part}" if raw else part
            if raw not in self.paths:
                kept.append(part)
        return ".".join(kept)


def _unique(pairs: Iterable[tuple[str, str]], what: str) -> dict[str, str]:
    """``canonical -> raw`` from ``(raw, canonical)`` pairs, refusing two raw names with one canonical."""
    result: dict[str, str] = {}
    for raw, canonical in pairs:
        if result.setdefault(canonical, raw) != raw:
            raise StateEncodingError(
                f"the model's {what} {result[canonical]!r} and {raw!r} both unwrap to {canonical!r}; "
                "rename one of the submodules"
            )
    return result


def state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` under canonical names (the live tensors)."""
    canonical = Canonical(model)
    raw = model.state_dict(keep_vars=True)
    if not canonical.paths:  # no wrapper: the names are canonical already
        return dict(raw)
    names = _unique(((name, canonical(name)) for name in raw), "state_dict keys")
    return {name: raw[raw_name] for name, raw_name in names.items()}


def parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``model.named_parameters()`` under canonical names (tied parameters under their first name)."""
    canonical = Canonical(model)
    raw = dict(model.named_parameters())
    if not canonical.paths:
        return raw
    names = _unique(((name, canonical(name)) for name in raw), "parameters")
    return {name: raw[raw_name] for name, raw_name in names.items()}


@dataclass(frozen=True)
class ModelNames:
    """What a save needs of a model's names: its state_dict and its parameters, canonical (the
    live tensors)."""

    state_dict: dict[str, torch.Tensor]
    parameters: dict[str, torch.nn.Parameter]

    @functools.cached_property
    def model_keys(self) -> list[str]:
        """The manifest key of each state_dict entry, in order (made once per walk)."""
        return [keys.model_key(name) for name in self.state_dict]


def model_names(model: torch.nn.Module) -> ModelNames:
    """:func:`state_dict` and :func:`parameters` of ``model``, walked now."""
    return ModelNames(state_dict(model), parameters(model))


_Shape = tuple[Any, ...]


def _shape(module: torch.nn.Module) -> _Shape:
    """What of ``module`` itself decides its part of the state_dict: its class, its children (a
    copy of its dict of them: comparing two is one C call, by identity), its parameters and
    buffers (names and object ids: a tensor the cache holds keeps its id), which buffers
    persist, and how many state_dict hooks it has. :meth:`_Walk.holds` compares these."""
    d = module.__dict__
    parameters, buffers = d["_parameters"], d["_buffers"]
    return (
        module.__class__,
        dict(d["_modules"]),
        tuple(parameters),
        tuple(map(id, parameters.values())),
        tuple(buffers),
        tuple(map(id, buffers.values())),
        frozenset(d["_non_persistent_buffers_set"]),
        len(d["_state_dict_hooks"]) + len(d["_state_dict_pre_hooks"]),
    )


def _plain(module: torch.nn.Module) -> bool:
    """Whether ``module``'s state_dict is its registered tensors as they are: no state_dict hook
    and no class that writes its own (quantized layers do, with tensors made at each call), nor
    one that redefines equality."""
    cls = type(module)
    return (
        cls.__eq__ is object.__eq__  # children are compared with ==, which must mean identity
        and not module._state_dict_hooks
        and not module._state_dict_pre_hooks
        and cls.state_dict is torch.nn.Module.state_dict
        and cls._save_to_state_dict is torch.nn.Module._save_to_state_dict
    )


@dataclass
class _Walk:
    """One walk of a model, and what to compare to know it still holds."""

    modules: list[torch.nn.Module]  # the root excluded: the cache holds it only weakly
    shapes: list[_Shape]
    root_shape: _Shape
    names: ModelNames

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is laid out as when this walk was taken: :func:`_shape` of every
        module compared inline (no names built, no generator; 1.2 us a module)."""
        if _shape(model) != self.root_shape:
            return False
        for module, (cls, children, p_names, p_ids, b_names, b_ids, transient, hooks) in zip(
            self.modules, self.shapes, strict=True
        ):
            d = module.__dict__
            if module.__class__ is not cls or d["_modules"] != children:
                return False
            parameters, buffers = d["_parameters"], d["_buffers"]
            if (parameters or p_names) and (
                tuple(parameters) != p_names or tuple(map(id, parameters.values())) != p_ids
            ):
                return False
            if (buffers or b_names) and (tuple(buffers) != b_names or tuple(map(id, buffers.values())) != b_ids):
                return False
            if d["_non_persistent_buffers_set"] != transient:
                return False
            if len(d["_state_dict_hooks"]) + len(d["_state_dict_pre_hooks"]) != hooks:
                return False
        return True


class NamesCache:
    """The names of models a client saves, walked again only when a model's layout changed.

    A training loop that saves every step walks the same modules every step; over a thousand
    modules, the walk and its names cost more than copying the trainable state. The cache
    keeps each model's :class:`ModelNames` (by weak reference to the model) with the layout it
    was read from: every module's class, children, parameters, buffers and state_dict hooks.
    A save compares that layout, module by module, with the model's now, so a parameter
    replaced (``model.to()`` swaps buffers for new tensors), a submodule added or deleted, or
    a hook registered is seen, whichever way it was done. A model whose state_dict is not its
    registered tensors (a hook, or a class that writes its own) is walked at every save.
    """

    def __init__(self) -> None:
        self._walks: weakref.WeakKeyDictionary[torch.nn.Module, _Walk] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = 0

    def names(self, model: torch.nn.Module) -> ModelNames:
        """``model``'s names, from the cache while its layout is unchanged."""
        with self._lock:
            walk = self._walks.get(model)
        if walk is not None and walk.holds(model):
            self.hits += 1
            return walk.names
        modules = list(model.modules())
        shapes = [_shape(module) for module in modules]  # read before the names: a change between is seen next time
        names = model_names(model)
        registered = {id(t) for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
        if all(map(_plain, modules)) and all(id(t) in registered for t in names.state_dict.values()):
            with self._lock:
                self._walks[model] = _Walk(modules[1:], shapes[1:], shapes[0], names)
        else:
            with self._lock:
                self._walks.pop(model, None)
        return names


def strip_wrapper_parts(name: str) -> str:
    """``name`` without any part a wrapper adds; only for matching names saved before canonical names."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def match_names(stored: Iterable[str], expected: Iterable[str]) -> dict[str, str]:
    """``stored name -> expected name`` for stored names that differ from every expected one only by wrapper parts.

    A version saved before names were canonical holds a wrapped model's raw names
    (``module._orig_mod.0.weight``). Each such name matches the one expected (canonical) name
    that is equal to it once every wrapper part is dropped from both; a name that exists as
    stored, or whose stripped form matches no or several expected names, is left alone (and is
    reported as unexpected by a strict load).
    """
    expected = set(expected)
    stored = list(stored)
    leftover = [name for name in stored if name not in expected]
    if not leftover:
        return {}
    by_stripped: dict[str, list[str]] = {}
    for name in expected:
        by_stripped.setdefault(strip_wrapper_parts(name), []).append(name)
    taken = set(stored) & expected  # already matched exactly
    matched: dict[str, str] = {}
    for name in leftover:
        candidates = by_stripped.get(strip_wrapper_parts(name), [])
        if len(candidates) == 1 and candidates[0] not in taken:
            matched[name] = candidates[0]
            taken.add(candidates[0])
    return matched
