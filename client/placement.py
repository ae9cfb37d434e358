"""Where each loaded tensor goes, following the rules PyTorch's optimizers rely on.

- Model tensors go into the given model's parameters, or to the load device.
- Per-parameter optimizer state goes to its parameter's device.
- Adam-style ``step`` stays on the CPU unless the param group is ``fused`` or
  ``capturable``; then it is float32 on the parameter's device (what the fused and
  capturable kernels require).
- Tensors inside ``param_groups`` go to the device of that group's parameters.
- Optimizer tensors keep the dtype they were saved with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptstore.service.errors import StateMismatchError
from ckptstore.service.format.manifest import TensorEntry

HOST = torch.device("cpu")


def group_places_step_on_device(group: Mapping[str, Any]) -> bool:
    """True if a param group keeps ``step`` on the parameter's device (fused or capturable)."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


def device_for(entry: TensorEntry, param_devices: Mapping[str, torch.device], target: torch.device) -> torch.device:
    """The device a tensor described by ``entry`` must be materialized on."""
    if entry.placement == "host":
        return HOST
    if entry.placement == "target":
        return target
    assert entry.param is not None
    try:
        return param_devices[entry.param]
    except KeyError:
        raise StateMismatchError(
            f"{entry.key} belongs to parameter {entry.param!r}, which the model does not have",
            unexpected_keys=[entry.key],
        ) from None
