"""Which model tensors a load reads: stored names matched to the target's, optionally a glob subset.

Stored names are canonical (:mod:`client.names`); a version saved before they were may hold a
wrapped model's names, which are matched onto the target's where that is unambiguous. A load
with ``keys=["*lora_*"]`` reads only the tensors whose canonical names match one of the glob
patterns (:func:`fnmatch.fnmatchcase`: ``*`` also crosses dots) and compares stored and target
names within that subset only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from ckptstore.client import keys, names
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.manifest import Manifest


def check_patterns(patterns: Sequence[str] | None) -> list[str] | None:
    """The patterns as a list, refusing a bare string (which would be read letter by letter) or an empty one."""
    if patterns is None:
        return None
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise InvalidInputError(f"keys must be a list of glob patterns such as ['*lora_*'], not {patterns!r:.80}")
    if not patterns:
        raise InvalidInputError("keys=[] selects nothing; pass None to load every tensor")
    return list(patterns)


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``name`` is selected: every name when ``patterns`` is None."""
    return patterns is None or any(fnmatchcase(name, pattern) for pattern in patterns)


def _check_every_pattern_used(patterns: Sequence[str] | None, names_seen: Iterable[str]) -> None:
    if patterns is None:
        return
    seen = list(names_seen)
    unused = [p for p in patterns if not any(fnmatchcase(n, p) for n in seen)]
    if unused:
        raise InvalidInputError(
            f"key pattern(s) {unused} match no tensor of the version or the model; patterns are globs over "
            "state_dict names, e.g. '*lora_*' or 'model.layers.0.*'"
        )


def stored_model_names(manifest: Manifest) -> dict[str, str]:
    """``stored state_dict name -> manifest key`` for every model tensor of a version, in manifest order."""
    # Inlined model_name: this runs once per tensor of a version.
    found = {}
    for entry in manifest.tensors:
        key = entry.key
        if key.startswith("model/"):
            found[key[6:] if "~" not in key else keys.model_name(key)] = key
    return found


@dataclass
class ModelPlan:
    """What a load into a model reads and where: ``sources`` maps each target name to load
    (canonical) to its manifest key; ``targets`` holds the model's live tensors by canonical name."""

    sources: dict[str, str]
    targets: dict[str, torch.Tensor]
    missing: list[str]
    unexpected: list[str]


def plan_model_load(manifest: Manifest, model: torch.nn.Module, patterns: Sequence[str] | None) -> ModelPlan:
    """Match the version's model tensors to ``model``'s, within the ``patterns`` subset if given."""
    stored = stored_model_names(manifest)
    every_target = names.state_dict(model)
    renamed = names.match_names(stored, every_target)
    by_name = {renamed.get(name, name): key for name, key in stored.items()}
    _check_every_pattern_used(patterns, [*by_name, *every_target])
    selected = {name: key for name, key in by_name.items() if matches(name, patterns)}
    targets = {name: t for name, t in every_target.items() if matches(name, patterns)}
    missing = sorted(targets.keys() - selected.keys())
    unexpected = sorted(selected.keys() - targets.keys())
    sources = {name: key for name, key in selected.items() if name in targets}
    return ModelPlan(sources, targets, missing, unexpected)


def selected_model_keys(manifest: Manifest, patterns: Sequence[str] | None) -> dict[str, str]:
    """``stored name -> manifest key`` of the model tensors ``patterns`` select (every one for None)."""
    stored = stored_model_names(manifest)
    _check_every_pattern_used(patterns, stored)
    return {name: key for name, key in stored.items() if matches(name, patterns)}
