"""Undo what a stock ``Optimizer.load_state_dict`` does to a checkpoint's optimizer state.

Frameworks that load optimizer state themselves (Lightning) hand the saved state dict to
``optimizer.load_state_dict``, which casts every floating state tensor to its parameter's dtype
(an optimizer's bf16 state comes back fp32) and leaves tensors inside ``param_groups`` where
they were loaded, whatever device the parameters are on now. :func:`repair_loaded_optimizer`
puts both right afterwards, by the placement rules of :mod:`client.placement`: state keeps its
saved dtype on its parameter's device, group tensors go to their parameters' device, and
``step`` stays where the loader put it (which follows ``fused`` / ``capturable``).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch


def repair_loaded_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> int:
    """Put ``optimizer``'s state back to the dtypes of ``saved`` (the state dict it was just
    loaded from) and move tensors in its param_groups to their parameters' device; returns how
    many tensors were replaced."""
    saved_groups = saved.get("param_groups")
    saved_state = saved.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        return 0
    ids = chain.from_iterable(group["params"] for group in saved_groups)
    params = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    replaced = 0
    for param_id, param in zip(ids, params, strict=False):
        ours, theirs = saved_state.get(param_id), optimizer.state.get(param)
        if isinstance(ours, dict) and isinstance(theirs, dict):
            replaced += _restore_dtypes(theirs, ours)
    for group in optimizer.param_groups:
        device = group["params"][0].device if group["params"] else None
        for name, value in group.items():
            if name != "params" and isinstance(value, torch.Tensor) and device is not None and value.device != device:
                group[name] = value.to(device)
                replaced += 1
    return replaced


def _restore_dtypes(loaded: dict[str, Any], saved: dict[str, Any]) -> int:
    """Replace each loaded state tensor whose dtype the loader changed by the saved one, on the
    loaded tensor's device (``step`` excepted: the loader places it on purpose)."""
    replaced = 0
    for name, value in saved.items():
        current = loaded.get(name)
        if (
            name != "step"
            and isinstance(value, torch.Tensor)
            and isinstance(current, torch.Tensor)
            and current.shape == value.shape
            and current.dtype != value.dtype
        ):
            loaded[name] = value.to(current.device)
            replaced += 1
    return replaced
