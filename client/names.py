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

import sys
from collections.abc import Iterable

import torch

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
