"""Hugging Face ``Trainer`` checkpoints as ckptstore versions.

``Trainer(..., callbacks=[CkptstoreCallback("my-run")])`` stores, at every step the Trainer would
save a ``checkpoint-N`` folder, a version instead: the model (a PEFT model's frozen base is
stored once, so each version costs about the adapter and its optimizer state), the optimizer,
the LR scheduler, the ``TrainerState`` (JSON) and the random number generators' state, with the
step and the metrics logged at that step. The model's configs travel with it
(:mod:`client.integrations.model_configs`): ``extra["model_config"]`` and
``extra["generation_config"]`` (what ``save_pretrained`` writes as ``config.json`` and
``generation_config.json``) and a PEFT model's adapter config as ``extra["peft_config"]`` (what
``adapter_config.json`` holds), so ``ckptstore export`` writes folders ``from_pretrained`` loads.
No checkpoint folder is written.
``save_total_limit`` becomes the run's retention policy (keep the last N versions, plus the best
by ``metric_for_best_model`` when set).

``resume(trainer, "my-run")`` is ``trainer.train(resume_from_checkpoint=...)`` from a version: the
Trainer fast-forwards its data and restores its state as from a folder, so the run continues
bit for bit. A version imported from a Trainer's own ``checkpoint-N`` folder (``ckptstore
import``) resumes the same way: its RNG state is kept as the Trainer wrote it
(``extra["rng_state"]``) and read in that layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import SaveStrategy

from ckptstore.client import jsonstate
from ckptstore.client.api import Client
from ckptstore.client.integrations.model_configs import model_configs
from ckptstore.client.integrations.rng import capture_rng, from_trainer_layout, restore_rng
from ckptstore.client.integrations.wrapped import inner_optimizer, inner_scheduler
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from ckptstore.service.format.names import LATEST, METRIC_PATTERN, validate_run_id

#: What the Trainer reads from a checkpoint folder besides the tensors (transformers' TRAINER_STATE_NAME).
TRAINER_STATE_FILE = "trainer_state.json"
#: Where a version imported from a Trainer folder keeps its ``rng_state*.pth`` files, by file stem.
IMPORTED_RNG = "rng_state"
_METRIC_RE = re.compile(METRIC_PATTERN)


def _client(client: Client | None) -> Client:
    if client is not None:
        return client
    from ckptstore.client import default_client

    return default_client()


def logged_metrics(state: TrainerState) -> dict[str, float]:
    """The numbers logged at the current step (training loss, learning rate, evaluation metrics)."""
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != state.global_step:
            continue
        for name, value in entry.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if _METRIC_RE.fullmatch(name) and math.isfinite(value):
                metrics[name] = float(value)
    return metrics


class CkptstoreCallback(TrainerCallback):
    """Saves a version of ``run_id`` wherever the Trainer would save a checkpoint folder.

    The version is taken once the step's logging and evaluation are done, so its metrics hold
    them, and before the next step changes anything. ``save_strategy="best"`` is refused (the
    Trainer decides it after every callback has run); keep the best versions with
    ``metric_for_best_model`` and ``save_total_limit`` instead.

    Each version's ``extra`` holds ``trainer_state``, ``rng`` and the model's configs
    (:func:`model_configs`).

    Args:
        run_id: the run every checkpoint becomes a version of.
        client: the store (default: :func:`client.default_client`).
    """

    def __init__(self, run_id: str, *, client: Client | None = None) -> None:
        self.run_id = validate_run_id(run_id)
        self._client = client
        self._due: str | None = None  # the event after which the pending save is taken
        self.saved: list[int] = []  # versions saved by this callback, oldest first

    @property
    def client(self) -> Client:
        """The client versions go through."""
        self._client = _client(self._client)
        return self._client

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Refuse what cannot be honoured before any step runs."""
        if args.save_strategy == SaveStrategy.BEST:
            raise InvalidInputError(
                "CkptstoreCallback cannot follow save_strategy='best'; use 'steps' or 'epoch' with "
                "metric_for_best_model and save_total_limit: the best version is then always kept"
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Take over a save the Trainer planned for this step."""
        self._take_over(args, state, control, kw)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Take over a save the Trainer planned for the end of the epoch."""
        self._take_over(args, state, control, kw)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Save now if the step's logs were the last thing to wait for."""
        if self._due == "log":
            self._save(args, state, kw)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Save now that the step's evaluation metrics are logged."""
        if self._due == "evaluate":
            self._save(args, state, kw)

    def _take_over(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kw: dict) -> None:
        # The Trainer logs, then evaluates, then saves, all after these events; clearing
        # should_save keeps it from writing a folder, and the version is taken after the
        # last of the step's logging and evaluation.
        if not control.should_save:
            return
        control.should_save = False
        # The Trainer logs a step once: at an epoch's end its last step is often logged already.
        logged = any(entry.get("step") == state.global_step for entry in state.log_history)
        if control.should_evaluate:
            self._due = "evaluate"
        elif control.should_log and not logged:
            self._due = "log"
        else:
            self._save(args, state, kw)

    def _save(self, args: TrainingArguments, state: TrainerState, kw: dict) -> None:
        self._due = None
        optimizer = kw.get("optimizer")
        model = kw["model"]
        limit = args.save_total_limit
        best = args.metric_for_best_model
        if best is not None and not best.startswith("eval_"):
            best = f"eval_{best}"
        result = self.client.save(
            self.run_id,
            model,
            inner_optimizer(optimizer) if optimizer is not None else None,
            scheduler=inner_scheduler(kw.get("lr_scheduler")),
            extra={"trainer_state": dataclasses.asdict(state), "rng": capture_rng(), **model_configs(model)},
            step=state.global_step,
            metrics=logged_metrics(state),
            keep_last=limit,
            keep_best=1 if limit and best else None,
            metric=best if limit and best else None,
            mode=("max" if args.greater_is_better else "min") if limit and best else None,
        )
        self.saved.append(result.version)


RngReader = Callable[[dict[str, Any]], dict[str, Any]]


def rng_reader(extra: dict[str, Any], args: TrainingArguments, where: str) -> RngReader:
    """How to find this process's RNG state in a version's loaded ``extra``, checked from the
    manifest before anything is loaded.

    A version saved by :class:`CkptstoreCallback` holds ``extra["rng"]`` (:func:`capture_rng`'s
    layout); one imported from a Trainer folder holds each ``rng_state*.pth`` file under
    ``extra["rng_state"][<file stem>]`` in the Trainer's layout, and this process reads the file
    the Trainer would: ``rng_state`` alone, ``rng_state_<process index>`` in a distributed run.

    Raises:
        StateMismatchError: the version holds no RNG state for this process (``where`` names it).
    """
    if "rng" in extra:
        return lambda loaded: loaded["rng"]
    files = extra.get(IMPORTED_RNG)
    if isinstance(files, dict) and files:
        stem = f"rng_state_{args.process_index}" if args.world_size > 1 else "rng_state"
        if stem not in files:
            raise StateMismatchError(
                f"{where} was imported from a Trainer folder without {stem}.pth (it holds "
                f"{', '.join(f'{name}.pth' for name in sorted(files))}): the RNG state of this process "
                f"(index {args.process_index} of {args.world_size}) is not stored, so the run cannot continue "
                "bit for bit; resume with the number of processes that saved it"
            )
        return lambda loaded: from_trainer_layout(loaded[IMPORTED_RNG][stem])
    raise StateMismatchError(
        f"{where} holds no random number generator state (extra['rng'] as CkptstoreCallback saves it, or "
        "extra['rng_state'] from an imported Trainer folder with its rng_state.pth), so the run cannot "
        "continue bit for bit; nothing was loaded"
    )


@contextmanager
def _loading_from_store(
    trainer: Trainer, client: Client, run_id: str, version: int, read_rng: RngReader
) -> Iterator[None]:
    """The Trainer's checkpoint readers, on this instance, read ``version`` from the store.

    ``Trainer.train(resume_from_checkpoint=folder)`` reads the weights, then (once the optimizer
    and scheduler exist) their state, then the RNG state when it has fast-forwarded the data;
    these are its methods for each, and they go back to the Trainer's own afterwards.
    """
    saved_rng: dict[str, Any] = {}

    def load_everything(checkpoint: Any) -> None:
        optimizer = trainer.optimizer
        result = client.load(
            run_id,
            version,
            model=trainer.model,
            optim=inner_optimizer(optimizer) if optimizer is not None else None,
            scheduler=inner_scheduler(trainer.lr_scheduler),
        )
        saved_rng.update(read_rng(result.extra))

    def load_rng(checkpoint: Any) -> None:
        if not saved_rng:
            raise StateMismatchError(f"version {version} of {run_id!r} was not loaded before its RNG state")
        restore_rng(saved_rng)

    replaced: dict[str, Callable[..., None]] = {
        "_load_from_checkpoint": lambda checkpoint, model=None: None,  # the weights come with the optimizer
        "_load_optimizer_and_scheduler": load_everything,
        "_load_rng_state": load_rng,
        "_load_scaler": lambda checkpoint: None,
    }
    for name, method in replaced.items():
        setattr(trainer, name, method)
    try:
        yield
    finally:
        for name in replaced:
            delattr(trainer, name)


def resume(
    trainer: Trainer, run_id: str, ref: int | str = LATEST, *, client: Client | None = None, **train_kwargs: Any
) -> Any:
    """Resume ``trainer`` from version ``ref`` of ``run_id`` and train on; returns what ``train()`` returns.

    The equivalent of ``trainer.train(resume_from_checkpoint=...)``: the model, optimizer,
    scheduler, ``TrainerState`` and RNG state come from the store, every byte verified, and the
    Trainer fast-forwards its data loader past the steps already trained. Only the
    ``TrainerState`` passes through a temporary folder, as the JSON file the Trainer reads.
    The version may come from :class:`CkptstoreCallback` or from ``ckptstore import`` of a
    Trainer ``checkpoint-N`` folder.

    Raises:
        StateMismatchError: the version holds no ``TrainerState`` or no RNG state for this
            process; nothing is loaded.
    """
    store = _client(client)
    manifest = store.transport.manifest(validate_run_id(run_id), ref)
    where = f"version {manifest.version} of {run_id!r}"
    extra = manifest.state.get("extra")
    if not isinstance(extra, dict) or "trainer_state" not in extra:
        raise StateMismatchError(
            f"{where} holds no TrainerState: save with CkptstoreCallback, or import a Trainer checkpoint folder"
        )
    read_rng = rng_reader(extra, trainer.args, where)

    def no_tensors(key: str) -> Any:
        raise StateMismatchError(f"the stored TrainerState refers to tensor {key!r}")

    trainer_state = jsonstate.decode(extra["trainer_state"], no_tensors)
    with tempfile.TemporaryDirectory(prefix="ckptstore-resume-") as folder:
        (Path(folder) / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state))
        with _loading_from_store(trainer, store, run_id, manifest.version, read_rng):
            return trainer.train(resume_from_checkpoint=folder, **train_kwargs)
