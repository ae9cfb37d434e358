"""Accelerate's ``save_state`` / ``load_state`` through ckptstore.

``save_state(accelerator, "my-run")`` stores every model, optimizer and scheduler the
``Accelerator`` prepared, the objects registered with ``register_for_checkpointing``, the
accelerator's step counter and the random number generators' state as the next version of the
run; ``load_state(accelerator, "my-run")`` puts them all back, every byte verified.

The version's step is the number of optimizer updates made so far, across epochs: what
Accelerate's examples count as ``completed_steps`` (one per ``accelerator.sync_gradients``
step under gradient accumulation). It is counted by a post-step hook on every optimizer
(``torch.optim.optimizer.register_optimizer_step_post_hook``) from the moment this module is
imported, so import it before training starts; ``load_state`` sets the count back to the
version's, so a resumed run counts on. (``accelerator.step``, also stored and restored, is
Accelerate's gradient accumulation counter: it goes back to 0 at every epoch's end.) An update
the AMP grad scaler skips is not counted. ``save_state(..., step=N)`` names the step
explicitly.

Optimizer state goes where ckptstore's placement rules put it (per-parameter state and tensors
inside ``param_groups`` on their parameters' device, Adam's ``step`` on the CPU unless fused or
capturable, saved dtypes kept), which Accelerate's own loader does not do for state kept in
``param_groups``.

Several prepared models are stored as one model whose parameters are named ``<index>.<name>``
(index in preparation order); one model keeps its own names. One optimizer at most: its state is
keyed by the names of the parameters it updates.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from accelerate import Accelerator
from torch.optim.optimizer import register_optimizer_step_post_hook

from ckptstore.client.api import Client
from ckptstore.client.integrations.rng import capture_rng, restore_rng
from ckptstore.client.integrations.wrapped import inner_optimizer, inner_scheduler
from ckptstore.client.results import LoadResult, SaveResult
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from ckptstore.service.format.names import LATEST

#: Optimizer updates made by each optimizer (the optimizer Accelerate wraps) since this module was
#: imported, or since :func:`load_state` set the count.
_updates: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _count_update(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _updates[optimizer] = _updates.get(optimizer, 0) + 1


register_optimizer_step_post_hook(_count_update)


def optimizer_updates(optimizer: torch.optim.Optimizer) -> int:
    """How many times ``optimizer`` (the optimizer an ``AcceleratedOptimizer`` wraps) has stepped."""
    return _updates.get(optimizer, 0)


def _client(client: Client | None) -> Client:
    if client is not None:
        return client
    from ckptstore.client import default_client

    return default_client()


def _model(accelerator: Accelerator) -> torch.nn.Module:
    """The prepared models as one module: the model itself, or a ModuleDict of them by index."""
    models = [accelerator.unwrap_model(m) for m in accelerator._models]
    if not models:
        raise InvalidInputError("the accelerator has prepared no model: pass the model to accelerator.prepare first")
    if len(models) == 1:
        return models[0]
    return torch.nn.ModuleDict({str(index): model for index, model in enumerate(models)})


def _optimizer(accelerator: Accelerator) -> torch.optim.Optimizer | None:
    optimizers = accelerator._optimizers
    if len(optimizers) > 1:
        raise InvalidInputError(
            f"the accelerator has prepared {len(optimizers)} optimizers; a version holds one: "
            "save each model with its optimizer as a run of its own (client.save)"
        )
    return inner_optimizer(optimizers[0]) if optimizers else None


def save_state(
    accelerator: Accelerator,
    run_id: str,
    *,
    client: Client | None = None,
    step: int | None = None,
    metrics: dict[str, float] | None = None,
    tags: list[str] | tuple[str, ...] = (),
) -> SaveResult | None:
    """Store the accelerator's prepared models, optimizer, schedulers, registered objects and RNG
    state as the next version of ``run_id``, like ``accelerator.save_state(folder)``.

    ``step`` and ``metrics`` describe the version (default step: the optimizer updates made so
    far, across epochs; none without an optimizer).
    Call it on every process: the main one saves and returns the result (the others None),
    and all wait for it.
    """
    optimizer = _optimizer(accelerator)
    updates = optimizer_updates(optimizer) if optimizer is not None else None
    version: dict[str, Any] = {
        "schedulers": [inner_scheduler(s).state_dict() for s in accelerator._schedulers],
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "accelerator_step": accelerator.step,
        "optimizer_updates": updates,
        "rng": capture_rng(),
    }
    result: SaveResult | None = None
    if accelerator.is_main_process:
        result = _client(client).save(
            run_id,
            _model(accelerator),
            optimizer,
            extra=version,
            step=updates if step is None else step,
            metrics=metrics,
            tags=tags,
        )
    accelerator.wait_for_everyone()
    return result


def _restore_each(kind: str, objects: list[Any], states: Any, version: int) -> None:
    if not isinstance(states, list) or len(states) != len(objects):
        saved = len(states) if isinstance(states, list) else 0
        raise StateMismatchError(f"version {version} holds {saved} {kind}, the accelerator has {len(objects)}")
    for obj, state in zip(objects, states, strict=True):
        obj.load_state_dict(state)


def load_state(
    accelerator: Accelerator,
    run_id: str,
    ref: int | str = LATEST,
    *,
    client: Client | None = None,
    strict: bool = True,
) -> LoadResult:
    """Load version ``ref`` of ``run_id`` into the accelerator's prepared objects, like
    ``accelerator.load_state(folder)``; returns the load's report.

    The accelerator must have prepared the same models, optimizer and schedulers, and registered
    the same objects, as when the version was saved. Model tensors are copied into the prepared
    models where they are; optimizer state lands by ckptstore's placement rules; the RNG state,
    the accelerator's step counter and the count of optimizer updates (the next version's
    default step counts on from it) come back too.
    """
    optimizer = _optimizer(accelerator)
    result = _client(client).load(run_id, ref, model=_model(accelerator), optim=optimizer, strict=strict)
    extra = result.extra if isinstance(result.extra, dict) else {}
    if "rng" not in extra:
        raise StateMismatchError(f"version {result.version} of {run_id!r} was not saved by save_state")
    schedulers = [inner_scheduler(s) for s in accelerator._schedulers]
    _restore_each("schedulers", schedulers, extra.get("schedulers"), result.version)
    _restore_each("registered objects", accelerator._custom_objects, extra.get("custom"), result.version)
    accelerator.step = extra["accelerator_step"]
    if optimizer is not None:
        # Versions saved before the count was stored have only their step to go on.
        updates = extra.get("optimizer_updates")
        _updates[optimizer] = updates if isinstance(updates, int) else result.step or 0
    restore_rng(extra["rng"])
    return result
