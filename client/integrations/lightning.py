"""Lightning's checkpoints as ckptstore versions: ``Trainer(plugins=[CkptstoreCheckpointIO("my-run")])``.

Every checkpoint Lightning writes (``ModelCheckpoint``'s top-k and ``last``, ``trainer.save_checkpoint``)
becomes a version of the run, tagged with the checkpoint's file name (see
:func:`client.integrations.paths.tag_for_path`); no file is written. Saving to a name again
moves its tag to the new version and deletes the version the name held before, unless another
tag keeps it, as overwriting a file would; ``ModelCheckpoint`` dropping a checkpoint from its
top k deletes the version the same way. With a ``ModelCheckpoint`` that has a ``monitor``, the
version it holds best also carries the tag ``best`` (moved as the best changes, across resumes).
Resume with ``trainer.fit(model, ckpt_path="ckptstore://my-run@last")`` (any ``RUN@REF``: a
number, ``latest`` or a tag), or with a path ``ModelCheckpoint`` reported (``best_model_path``,
``ckpt_path="best"``). :func:`load_from_checkpoint` is ``MyModule.load_from_checkpoint`` for a
version: ``load_from_checkpoint(MyModule, "ckptstore://my-run@best")`` builds the module from the
stored hyperparameters and loads its weights, as Lightning does from a file. A Lightning
``.ckpt`` brought in with ``ckptstore import`` is stored the same way as the versions saved here
(:mod:`client.formats.lightning_ckpt`), so it resumes and loads like them.

The model's weights are stored as model tensors (deduplicated across versions); optimizer
states, schedulers, loops, callback state and hyperparameters as JSON, their tensors by key with
their dtype and device class. A value that is neither is refused, naming its key; nothing is
pickled.

``CkptstoreCheckpointIO`` subclasses the ``lightning`` package's ``CheckpointIO`` (or, without
it, ``pytorch_lightning``'s); ``PLCkptstoreCheckpointIO`` is always ``pytorch_lightning``'s.
:class:`ResumeStateCallback` adds the random number generators' state to every checkpoint, so a
resumed run is bit-exact even with dropout and shuffled data, and gives optimizer state back the
dtypes and devices Lightning's own loading takes from it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, TypeVar

import torch

from ckptstore.client.api import Client
from ckptstore.client.formats.lightning_ckpt import VERSION_KEY, WEIGHTS_KEY, monitored_metrics
from ckptstore.client.integrations.optimizer_repair import repair_loaded_optimizer
from ckptstore.client.integrations.paths import StoreRef, parse_store_path, tag_for_path
from ckptstore.client.integrations.rng import capture_rng, restore_rng
from ckptstore.client.integrations.trees import load_tree, save_tree
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.names import LATEST, validate_run_id
from ckptstore.service.format.records import VersionInfo

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Callback
except ImportError:  # only the pytorch_lightning distribution is installed
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[assignment]
    from pytorch_lightning import Callback  # type: ignore[assignment]

#: The tag on the version ``ModelCheckpoint`` (with a ``monitor``) holds best.
BEST = "best"
_Module = TypeVar("_Module")


class _StoreCheckpointIO:
    """What both packages' plug-ins do; the concrete classes add Lightning's base class."""

    def __init__(self, run_id: str, *, client: Client | None = None) -> None:
        """Store checkpoints as versions of ``run_id`` through ``client`` (default: :func:`client.default_client`)."""
        super().__init__()
        self.run_id = validate_run_id(run_id)
        self._client = client

    @property
    def client(self) -> Client:
        """The client versions go through."""
        if self._client is None:
            from ckptstore.client import default_client

            self._client = default_client()
        return self._client

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Store ``checkpoint`` as the next version, tagged with ``path``'s file name (or the tag a
        ``ckptstore://RUN@TAG`` path names); the version the tag held before goes unless another tag keeps it."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        run_id, tag = self._tagged_target(path)
        previous = self._holder(run_id, tag)
        best = None if tag == BEST else self._best_tag_target(checkpoint, run_id)
        saved = save_tree(
            self.client,
            run_id,
            checkpoint,
            weights_key=WEIGHTS_KEY,
            step=checkpoint.get("global_step"),
            metrics=monitored_metrics(checkpoint),
            tags=[tag, BEST] if best == tag else [tag],
        )
        best_version = saved.version if best == tag else None
        if best is not None and best != tag:
            holder = self._holder(run_id, best)
            if holder is not None and BEST not in holder.tags:
                self.client.tag(run_id, holder.version, BEST)
            best_version = holder.version if holder is not None else None
        if previous is not None:
            kept = set(previous.tags) - {tag}
            if best_version is not None and best_version != previous.version:
                kept.discard(BEST)  # the best tag moved off it
            if not kept:
                self.client.delete(run_id, previous.version)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict stored at ``path``: ``ckptstore://RUN@REF`` or a path this plug-in saved to.

        With ``map_location`` None every tensor returns to the device class it was saved from;
        given a device (or its name), every tensor goes there. ``weights_only`` changes
        nothing: nothing stored is ever unpickled.
        """
        ref = parse_store_path(path) or StoreRef(self.run_id, tag_for_path(path))
        return load_tree(self.client, ref, weights_key=WEIGHTS_KEY, map_location=map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Drop ``path``'s tag, and its version unless another tag keeps it (nothing if no version holds it)."""
        run_id, tag = self._tagged_target(path)
        holder = self._holder(run_id, tag)
        if holder is None:
            return
        if set(holder.tags) == {tag}:
            self.client.delete(run_id, holder.version)
        else:
            self.client.untag(run_id, tag)

    def _tagged_target(self, path: Any) -> tuple[str, str]:
        """(run, tag) a save or removal at ``path`` works on."""
        ref = parse_store_path(path)
        if ref is None:
            return self.run_id, tag_for_path(path)
        if not isinstance(ref.ref, str) or ref.ref == LATEST:
            raise InvalidInputError(f"{path}: a checkpoint is saved under a tag (ckptstore://RUN@TAG), not {ref.ref!r}")
        return ref.run_id, ref.ref

    def _best_tag_target(self, checkpoint: dict[str, Any], run_id: str) -> str | None:
        """The tag of the checkpoint ``ModelCheckpoint`` holds best, when it is one of ``run_id``'s.

        Only a ``ModelCheckpoint`` with a ``monitor`` has a best; with several, they must agree.
        None too when one of its files is named ``best``: that file owns the tag.
        """
        callbacks = checkpoint.get("callbacks")
        states = [
            state
            for state in (callbacks.values() if isinstance(callbacks, dict) else ())
            if isinstance(state, dict) and isinstance(state.get("monitor"), str)
        ]
        best_paths = {state.get("best_model_path") for state in states}
        best_path = best_paths.pop() if len(best_paths) == 1 else None
        if not isinstance(best_path, str) or not best_path:
            return None
        files: list[Any] = [best_path]
        for state in states:
            files += [*(state.get("best_k_models") or {}), state.get("last_model_path")]
        if any(isinstance(file, str) and os.path.splitext(os.path.basename(file))[0] == BEST for file in files):
            return None
        try:
            best_run, best_tag = self._tagged_target(best_path)
        except (InvalidInputError, TypeError):  # not a path this plug-in saves to: no version to tag
            return None
        return best_tag if best_run == run_id and best_tag != BEST else None

    def _holder(self, run_id: str, tag: str) -> VersionInfo | None:
        """The version ``tag`` points at, if any."""
        try:
            versions = self.client.versions(run_id)
        except NotFoundError:
            return None
        return next((v for v in versions if tag in v.tags), None)


class CkptstoreCheckpointIO(_StoreCheckpointIO, CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints as versions of one run.

    Args:
        run_id: the run every checkpoint becomes a version of.
        client: the store (default: :func:`client.default_client`, from ``CKPTSTORE_URL`` /
            ``CKPTSTORE_HOME``).
    """


class ResumeStateCallback(Callback):
    """Keeps what Lightning's own resume loses, and puts it back.

    - The random number generators (Python's, NumPy's, torch's): their state goes into every
      checkpoint (as tensors and JSON, under this callback's key in ``callbacks``) and comes
      back on resume, so with dropout or a shuffled sampler a resumed run draws exactly what the
      uninterrupted one did.
    - Optimizer state as saved: Lightning loads it with ``optimizer.load_state_dict``, which
      casts floating state to the parameter's dtype (an optimizer's bf16 state comes back fp32)
      and leaves tensors in ``param_groups`` (Prodigy's ``running_d_*``) where they were loaded.
      When training starts, each state tensor gets its saved dtype back and each group tensor
      moves to its parameters' device (:mod:`client.integrations.optimizer_repair`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._optimizer_states: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        """The generators' state now (Lightning calls this as it builds a checkpoint)."""
        return capture_rng()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the generators back as they were when the checkpoint was built."""
        restore_rng(state_dict)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the optimizer states as the checkpoint holds them, for :meth:`on_train_start`."""
        states = checkpoint.get("optimizer_states")
        self._optimizer_states = list(states) if isinstance(states, list) else []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Once Lightning has loaded the optimizers: saved dtypes back, group tensors placed."""
        states, self._optimizer_states = self._optimizer_states, []
        for optimizer, saved in zip(trainer.optimizers, states, strict=False):
            if isinstance(saved, dict):
                repair_loaded_optimizer(optimizer, saved)


def load_from_checkpoint(
    cls: type[_Module],
    path: str,
    *,
    client: Client | None = None,
    map_location: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> _Module:
    """``cls.load_from_checkpoint`` for a version: ``load_from_checkpoint(MyModule, "ckptstore://RUN@REF")``.

    The module (or ``LightningDataModule``) is built as Lightning's own ``load_from_checkpoint``
    builds it from a file: ``__init__`` called with the stored ``hyper_parameters`` updated by
    ``kwargs``, ``on_load_checkpoint`` called, the weights loaded (``strict`` as Lightning takes
    it), the module moved to the weights' device. Any version holding a Lightning checkpoint
    works: one the plug-in saved, or a ``.ckpt`` brought in with ``ckptstore import``.

    Args:
        cls: the ``LightningModule`` or ``LightningDataModule`` class to build.
        path: ``ckptstore://RUN@REF`` (a number, ``latest`` or a tag, ``best`` included).
        client: the store (default: :func:`client.default_client`).
        map_location: None (every tensor to the device class it was saved from), or a device
            or its name.
        strict: whether every weight must match the module's (default: the module's
            ``strict_loading``, else True).
        kwargs: hyperparameters that replace the stored ones.

    Raises:
        InvalidInputError: ``path`` is not a ``ckptstore://`` reference.
        NotFoundError: no such run or version.
    """
    ref = parse_store_path(path)
    if ref is None:
        raise InvalidInputError(
            f"{str(path)[:200]!r} is not a store reference; name a version as ckptstore://RUN@REF "
            "(for a file, use the class's own load_from_checkpoint)"
        )
    if client is None:
        from ckptstore.client import default_client

        client = default_client()
    checkpoint = load_tree(client, ref, weights_key=WEIGHTS_KEY, map_location=map_location)
    # What Lightning's _load_from_checkpoint does once torch.load has given it the dict.
    lightning = _lightning_package(cls)
    package = importlib.import_module(lightning)
    saving = importlib.import_module(f"{lightning}.core.saving")
    if VERSION_KEY in checkpoint:  # a version saved from a hand-built dict may have none
        migration = importlib.import_module(f"{lightning}.utilities.migration.utils")
        checkpoint = migration._pl_migrate_checkpoint(checkpoint)
    if not issubclass(cls, (package.LightningModule, package.LightningDataModule)):
        raise TypeError(f"{cls.__name__} is neither a LightningModule nor a LightningDataModule")
    lightning_class: Any = cls  # Lightning is imported by name here, so its classes are Any to mypy
    checkpoint.setdefault(lightning_class.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    if issubclass(cls, package.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    module = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = (t for t in checkpoint[WEIGHTS_KEY].values() if isinstance(t, torch.Tensor))
    return module.to(next(tensors, torch.tensor(0)).device)


def _lightning_package(cls: type) -> str:
    """``pytorch_lightning`` for a class built on that distribution, else ``lightning.pytorch``."""
    if any(k.__module__.split(".")[0] == "pytorch_lightning" for k in cls.__mro__):
        return "pytorch_lightning"
    return "lightning.pytorch"


def __getattr__(name: str) -> Any:
    # Built on first use: pytorch_lightning is a separate distribution with its own base class.
    if name == "PLCkptstoreCheckpointIO":
        base = importlib.import_module("lightning_fabric.plugins").CheckpointIO
        cls = type(name, (_StoreCheckpointIO, base), {"__doc__": CkptstoreCheckpointIO.__doc__, "__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
