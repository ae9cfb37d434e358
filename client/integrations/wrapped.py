"""The optimizer and scheduler inside the wrappers Accelerate (and so Hugging Face ``Trainer``) adds.

``AcceleratedOptimizer`` and ``AcceleratedScheduler`` hold the real objects as ``.optimizer`` and
``.scheduler``; ckptstore saves and loads those, keyed by the model's parameter names. Found by
attribute, so Accelerate is not imported here.
"""

from __future__ import annotations

from typing import Any

import torch


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state, inside any wrappers."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def inner_scheduler(scheduler: Any) -> Any:
    """The scheduler that holds the state, inside any wrappers (None stays None)."""
    while hasattr(getattr(scheduler, "scheduler", None), "state_dict"):
        scheduler = scheduler.scheduler
    return scheduler
