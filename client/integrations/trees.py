"""A framework's checkpoint dict as a version, and back.

Frameworks hand a plug-in one dict: the model's weights under one key, everything else
(optimizer state dicts, loop counters, callback state, hyperparameters) beside them. The
weights become model tensors, so they dedup against every other version; the rest goes into
the version's ``extra`` as JSON with its tensors by key (each keeping its dtype and the device
class it was saved from); a value that is neither is refused, naming its key. Both ways go
through :meth:`Client.save_state_dict` and :meth:`Client.load`, the client's own paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptstore.client.api import Client
from ckptstore.client.integrations.paths import StoreRef
from ckptstore.client.results import SaveResult
from ckptstore.service.errors import InvalidInputError, StateEncodingError
from ckptstore.service.format.manifest import Manifest


def save_tree(
    client: Client,
    run_id: str,
    tree: Mapping[str, Any],
    *,
    weights_key: str,
    step: int | None = None,
    metrics: dict[str, float] | None = None,
    tags: list[str] | tuple[str, ...] = (),
) -> SaveResult:
    """Store ``tree`` as the next version of ``run_id``: ``tree[weights_key]`` as model tensors,
    the rest as extras.

    The weights are recorded as trainable: a checkpoint dict does not say which are frozen,
    so the digest cache never takes one for unchanged (dedup by digest works all the same).
    """
    if not isinstance(tree, Mapping):
        raise StateEncodingError(f"a checkpoint must be a dict, not {type(tree).__name__}")
    weights = tree.get(weights_key, {})
    if not isinstance(weights, Mapping):
        raise StateEncodingError(f"{weights_key}: a {type(weights).__name__}, not a dict of tensors")
    rest = {key: value for key, value in tree.items() if key != weights_key}
    return client.save_state_dict(run_id, weights, trainable=True, extra=rest, step=step, metrics=metrics, tags=tags)


def saved_device(manifest: Manifest) -> torch.device:
    """The accelerator a version was saved from (the first non-CPU device among its tensors), else the CPU."""
    for entry in manifest.tensors:
        if entry.device_type != "cpu":
            return torch.device(entry.device_type)
    return torch.device("cpu")


def load_device(manifest: Manifest, map_location: Any) -> torch.device | None:
    """Where a load puts the tensors: ``map_location`` (a device or its name), or with None the
    device class each tensor was saved from (None is returned then)."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise InvalidInputError(
        f"map_location must be None, a torch.device or a device name such as 'cpu', not "
        f"{type(map_location).__name__}: tensors come back where they were saved from, or all on that device"
    )


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (through dicts, lists and tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def load_tree(client: Client, ref: StoreRef, *, weights_key: str, map_location: Any = None) -> dict[str, Any]:
    """The dict :func:`save_tree` stored as version ``ref``, every byte verified.

    With ``map_location`` None each tensor goes back to the device class it was saved from
    (tensors saved from the CPU to the CPU, the others to that accelerator); given a device,
    every tensor goes there. dtypes are always the saved ones.
    """
    manifest = client.transport.manifest(ref.run_id, ref.ref)
    wanted = load_device(manifest, map_location)
    # Tensors saved from the CPU come back there and the rest to this device (see restore_section).
    result = client.load(ref.run_id, manifest.version, device=wanted or saved_device(manifest))
    tree: dict[str, Any] = dict(result.extra or {})
    tree[weights_key] = result.state_dict or {}
    return to_device(tree, wanted) if wanted is not None else tree
