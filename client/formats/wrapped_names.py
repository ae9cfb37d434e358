"""Imported names made canonical, as ``client.save`` stores them: without the parts wrappers add.

``torch.compile(model).state_dict()`` names ``_orig_mod.fc.weight`` and a DDP model's
``module.fc.weight``; ``client.save`` walks the live model and drops exactly the wrappers'
parts (:mod:`client.names`). An import has the names only, so it drops:

- every part only a wrapper makes (``_orig_mod``, ``_fsdp_wrapped_module``,
  ``_checkpoint_wrapped_module``: private attributes of torch's wrapper classes), wherever it
  stands;
- a first part ``module`` (DDP, DataParallel) when every name of the model starts with it, as
  ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` does: a user's own
  submodule may be called ``module`` too, and then some names lack it.

The optimizer's state names, where the source names its parameters, are renamed by the same
rule as the model's. Two names that would become one are refused, naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.service.errors import InvalidInputError

#: Parts of a name only a wrapper adds (the attribute each wrapper keeps its model in).
WRAPPER_ONLY_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
#: The part DDP and DataParallel add, also a name a user may give a submodule.
DATA_PARALLEL_PART = "module"


def canonical_rule(model_names: Iterable[str]) -> Callable[[str], str]:
    """The renaming of one import: what every name loses, decided from the model's ``model_names``."""
    stripped = [_without_wrapper_parts(name) for name in model_names]
    prefix = DATA_PARALLEL_PART + "."
    drop_prefix = bool(stripped) and all(name.startswith(prefix) and len(name) > len(prefix) for name in stripped)

    def rename(name: str) -> str:
        name = _without_wrapper_parts(name)
        return name[len(prefix) :] if drop_prefix and name.startswith(prefix) else name

    return rename


def _without_wrapper_parts(name: str) -> str:
    if not any(part in name for part in WRAPPER_ONLY_PARTS):  # the common case: one scan per part
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ONLY_PARTS)


def renamed(names: Iterable[str], rename: Callable[[str], str], where: str) -> dict[str, str]:
    """``name -> canonical name`` for ``names``, refusing two names that become one."""
    result: dict[str, str] = {}
    taken: dict[str, str] = {}
    for name in names:
        canonical = rename(name)
        first = taken.setdefault(canonical, name)
        if first != name:
            raise InvalidInputError(
                f"{where}: {shown(first, 80)} and {shown(name, 80)} both name {shown(canonical, 80)} once the "
                "parts torch.compile and DDP add are dropped; save the unwrapped model's state_dict"
            )
        result[name] = canonical
    return result


def canonical_model(model: dict[str, Any], rename: Callable[[str], str], where: str) -> dict[str, Any]:
    """``model`` (a state_dict) under canonical names, in its order."""
    names = renamed(model, rename, where)
    return {names[name]: value for name, value in model.items()}


def canonical_optimizer(optim: dict[str, Any], rename: Callable[[str], str], where: str) -> dict[str, Any]:
    """An optimizer state_dict keyed by parameter name under canonical names; one kept by position as it is."""
    groups = optim["param_groups"]
    listed = [name for group in groups for name in group["params"]]
    if not all(isinstance(name, str) for name in listed):
        return optim
    state = optim["state"]
    held = set(listed)
    names = renamed([*listed, *(name for name in state if name not in held)], rename, f"{where} (optimizer)")
    return {
        **optim,
        "state": {names[name]: value for name, value in state.items()},
        "param_groups": [{**group, "params": [names[name] for name in group["params"]]} for group in groups],
    }
