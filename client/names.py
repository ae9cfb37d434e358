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
import operator
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.client import keys
from ckptstore.service.errors import StateEncodingError

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


#: The parts of a module's ``__dict__`` that decide its part of the state_dict (with its class):
#: its children, parameters, buffers, which buffers persist, and its state_dict hooks.
_PARTS = operator.itemgetter(
    "_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks"
)
_Shape = tuple[Any, ...]


class _Is:
    """Equal to one object only, by identity: a tensor in a copied dict of parameters or buffers
    (comparing tensors with ``==`` would compare their values)."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return self.value is other


def _shape(module: torch.nn.Module) -> _Shape:
    """A copy of the parts (:data:`_PARTS`) of ``module`` that decide its part of the state_dict,
    comparable with ``==`` to the live parts: children by identity (a module compares so),
    tensors by identity (:class:`_Is`), hook dicts and the non-persistent set as they are."""
    children, parameters, buffers, transient, hooks, pre_hooks = _PARTS(module.__dict__)
    return (
        dict(children),
        {name: _Is(tensor) for name, tensor in parameters.items()},
        {name: _Is(tensor) for name, tensor in buffers.items()},
        set(transient),
        dict(hooks),
        dict(pre_hooks),
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
    types: list[type]
    shapes: list[_Shape]
    root_type: type
    root_shape: _Shape
    names: ModelNames

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is laid out as when this walk was taken: every module's class and
        :func:`_shape`, compared with the live ones in a few C loops (``map`` over the modules,
        list and dict equality); only tensors call back into Python, through :class:`_Is`."""
        if type(model) is not self.root_type or self.root_shape != _PARTS(model.__dict__):
            return False
        return self.types == list(map(type, self.modules)) and self.shapes == list(map(_PARTS, map(vars, self.modules)))


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

    def keeps(self, model: torch.nn.Module, known: ModelNames) -> bool:
        """Whether the cache keeps ``known`` as ``model``'s names (and hands them out again while
        its layout holds); a model walked at every save is not kept."""
        with self._lock:
            walk = self._walks.get(model)
        return walk is not None and walk.names is known

    def names(self, model: torch.nn.Module) -> ModelNames:
        """``model``'s names, from the cache while its layout is unchanged."""
        with self._lock:
            walk = self._walks.get(model)
        if walk is not None and walk.holds(model):
            self.hits += 1
            return walk.names
        modules = list(model.modules())
        try:
            shapes = [_shape(module) for module in modules]  # read before the names: a change between is seen
        except KeyError:  # a module without the attributes of today's nn.Module
            shapes = []
        names = model_names(model)
        registered = {id(t) for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
        if shapes and all(map(_plain, modules)) and all(id(t) in registered for t in names.state_dict.values()):
            types = list(map(type, modules))
            with self._lock:
                self._walks[model] = _Walk(modules[1:], types[1:], shapes[1:], types[0], shapes[0], names)
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
