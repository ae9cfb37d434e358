"""A version's ``resume`` section: what a training job needs to go on exactly where it stopped.

The section is JSON (tensors by key, under ``resume/``) of this shape::

    {"rng": <to_json(capture_rng())>,             # unless save(..., rng=False)
     "stateful": {"dataloader": <state_dict()>}}  # the objects passed to save()

``rng`` holds Python's ``random``, NumPy's global state, torch's CPU generator and every CUDA
device's (:mod:`client.resume.rng`), recorded with every version :meth:`client.api.Client.save`
writes, as plain JSON (:func:`client.resume.rng.to_json`): no tensors, so a save of an unchanged
model still adds no tensor bytes. ``stateful`` holds the ``state_dict()`` of each object passed
as ``dataloader=`` or in ``stateful=`` (anything with ``state_dict`` and ``load_state_dict``, the protocol
``torch.distributed.checkpoint`` calls ``Stateful``: a torchdata ``StatefulDataLoader``, a
sampler, a metric), by the name it was passed under.

:func:`plan` decides, before a load writes anything, what it restores: the objects passed to
``load`` (each must be recorded), and the generators when asked (``rng=True``; refused if the
version recorded none) or by default when the load is a resume (an optimizer is loaded) and the
version recorded them. A version saved before the section existed loads as it always did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore.client.resume.rng import capture_rng, from_json, restore_rng, to_json
from ckptstore.client.state import FlatState, flatten_other
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from ckptstore.service.format.manifest import Manifest, StateSection

SECTION: StateSection = "resume"
#: The name ``dataloader=`` stores its loader under in ``stateful``.
DATALOADER = "dataloader"


def stateful_objects(dataloader: Any, stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """The objects to save or restore by name: ``stateful``, and ``dataloader`` as ``"dataloader"``.

    Raises:
        InvalidInputError: a name is not 1-200 printable characters or is given twice, or an
            object lacks ``state_dict`` / ``load_state_dict``.
    """
    objects = dict(stateful or {})
    if dataloader is not None:
        if DATALOADER in objects:
            raise InvalidInputError("'dataloader' is given twice: as dataloader= and in stateful=; pass it once")
        objects[DATALOADER] = dataloader
    for name, value in objects.items():
        if not isinstance(name, str) or not 0 < len(name) <= 200 or not name.isprintable():
            raise InvalidInputError(f"stateful name {str(name)[:80]!r} must be 1-200 printable characters")
        if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
            raise InvalidInputError(
                f"stateful {name!r} is a {type(value).__name__}, which has no state_dict() and "
                "load_state_dict(): pass objects that do (a torchdata StatefulDataLoader, not a plain DataLoader)"
            )
    return objects


def record(flat: FlatState, *, rng: bool, objects: Mapping[str, Any]) -> None:
    """Add the ``resume`` section to ``flat``: the generators (with ``rng``) and each object's
    ``state_dict()``, taken now."""
    value: dict[str, Any] = {}
    if rng:
        value["rng"] = to_json(capture_rng())  # JSON, not tensors: it differs at every save
    if objects:
        value["stateful"] = {name: obj.state_dict() for name, obj in objects.items()}
    if value:
        flatten_other(flat, SECTION, value)


@dataclass(frozen=True)
class Restore:
    """What a load puts back from the ``resume`` section (:func:`plan`)."""

    rng: bool
    objects: dict[str, Any]

    @property
    def anything(self) -> bool:
        """Whether the section must be read at all."""
        return self.rng or bool(self.objects)


def plan(manifest: Manifest, *, rng: bool | None, resuming: bool, objects: Mapping[str, Any]) -> Restore:
    """What a load of ``manifest`` restores, checked before anything is written.

    ``rng``: True restores the generators, False never, None (the default) when ``resuming``
    (the load fills an optimizer) and the version recorded them.

    Raises:
        StateMismatchError: ``rng=True`` or an object is asked for that the version did not record.
    """
    section = manifest.state.get(SECTION)
    recorded = section if isinstance(section, dict) else {}
    stored = recorded.get("stateful")
    stored_names = set(stored) if isinstance(stored, dict) else set()
    absent = sorted(set(objects) - stored_names)
    if absent:
        held = f"it holds {', '.join(map(repr, sorted(stored_names)))}" if stored_names else "it holds none"
        raise StateMismatchError(
            f"version {manifest.version} holds no state for {', '.join(map(repr, absent))} ({held}); "
            "pass it to save(dataloader=... or stateful={...}) to record it"
        )
    has_rng = "rng" in recorded
    if rng and not has_rng:
        raise StateMismatchError(
            f"version {manifest.version} records no random number generator state (saved with rng=False, "
            "or before versions recorded it); load with rng=None or rng=False"
        )
    return Restore(rng=has_rng if rng is None and resuming else bool(rng), objects=dict(objects))


def apply(restore: Restore, decoded: Any) -> None:
    """Put back what ``restore`` names from the decoded ``resume`` section: each object's state,
    then the generators (last, so nothing drawn while restoring the rest moves them on).

    Each object's ``state_dict()`` is read once after its ``load_state_dict``, before the
    generators are restored: a ``StatefulDataLoader`` then builds the iterator the resumed loop
    will get from ``iter(loader)``, and that iterator's seed is drawn from torch's generator now,
    not after the restore, just as the uninterrupted run drew it when the epoch began. Without
    this the first step after a resume would see dropout masks one draw further on.

    Raises:
        StateMismatchError: the stored section is malformed.
    """
    if not isinstance(decoded, dict):
        raise StateMismatchError(f"the stored resume section is a {type(decoded).__name__}, not an object")
    stored = decoded.get("stateful") if restore.objects else None
    for name, obj in restore.objects.items():
        assert isinstance(stored, dict)  # plan() checked every name is recorded
        obj.load_state_dict(stored[name])
        obj.state_dict()
    if restore.rng:
        restore_rng(from_json(decoded["rng"]))
