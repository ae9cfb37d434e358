"""A Lightning ``.ckpt`` imported whole, as ``CkptstoreCheckpointIO`` stores the checkpoints it saves.

A Lightning checkpoint is one dict: the weights under ``state_dict`` and, beside them, what
``Trainer.fit(ckpt_path=...)`` resumes from (``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, ``epoch``, ``global_step``, ``pytorch-lightning_version``) and what
``load_from_checkpoint`` builds the module from (``hyper_parameters``). The import keeps every
top-level value a version can hold (JSON values, tuples, dicts and tensors: :mod:`client.jsonstate`),
so the version resumes through the plug-in (``ckpt_path="ckptstore://RUN@latest"``) exactly as the
file does. Any other value is left out by key, with why; one Lightning needs to resume refuses
the import instead.

The dict comes from :func:`client.formats.torch_save.files.read_torch_file` (never a general
unpickler); this module only decides what of it is stored.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypedDict

import torch

from ckptstore.client.formats.torch_dicts import tensor_dict, unstorable
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.names import METRIC_PATTERN

VERSION_KEY = "pytorch-lightning_version"
WEIGHTS_KEY = "state_dict"
#: What ``Trainer.fit(ckpt_path=...)`` reads back: kept whole, or the import is refused.
RESUME_KEYS = (
    WEIGHTS_KEY,
    "optimizer_states",
    "lr_schedulers",
    "loops",
    "callbacks",
    "epoch",
    "global_step",
    VERSION_KEY,
)
_METRIC_RE = re.compile(METRIC_PATTERN)


class ImportedFields(TypedDict):
    """The fields of a :class:`client.formats.sources.Imported` for a checkpoint stored whole."""

    model: dict[str, torch.Tensor]
    tree: dict[str, Any]
    weights_key: str
    step: int | None
    metrics: dict[str, float]
    left_out: dict[str, str]


def is_lightning_checkpoint(loaded: Any) -> bool:
    """Whether ``loaded`` is the dict Lightning saves (``pytorch-lightning_version`` and ``state_dict``)."""
    return isinstance(loaded, dict) and VERSION_KEY in loaded and WEIGHTS_KEY in loaded


def monitored_metrics(checkpoint: dict[str, Any]) -> dict[str, float]:
    """The scores ``ModelCheckpoint`` callbacks hold (``{monitor: current_score}``), as version metrics."""
    metrics: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    for state in callbacks.values() if isinstance(callbacks, dict) else ():
        if not isinstance(state, dict):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            score = score.item()
        if isinstance(monitor, str) and _METRIC_RE.fullmatch(monitor) and isinstance(score, (int, float)):
            if math.isfinite(score):
                metrics[monitor] = float(score)
    return metrics


def lightning_fields(checkpoint: dict[str, Any], where: str) -> ImportedFields:
    """What an import stores of the Lightning checkpoint ``checkpoint`` read from ``where``.

    Raises:
        InvalidInputError: ``state_dict`` is not a dict of tensors, or a value Lightning needs
            to resume cannot be stored (the message names its key and what is wrong).
    """
    weights = tensor_dict(checkpoint[WEIGHTS_KEY], f"{where}[{WEIGHTS_KEY!r}]")
    tree: dict[str, Any] = {WEIGHTS_KEY: weights}
    left_out: dict[str, str] = {}
    for key, value in checkpoint.items():
        if key == WEIGHTS_KEY:
            continue
        reason = unstorable(key, value)
        if reason is None:
            tree[key] = value
        elif key in RESUME_KEYS:
            raise InvalidInputError(
                f"{where}: {key!r} cannot be stored ({reason}), and Lightning needs it to resume; "
                "fix what saves it, or import the weights alone (torch.save the state_dict)"
            )
        else:
            left_out[str(key)[:80]] = reason
    step = checkpoint.get("global_step")
    return {
        "model": weights,
        "tree": tree,
        "weights_key": WEIGHTS_KEY,
        "step": step if type(step) is int else None,
        "metrics": monitored_metrics(checkpoint),
        "left_out": left_out,
    }
