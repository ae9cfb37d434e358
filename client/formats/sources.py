"""What ``ckptstore import`` reads: checkpoints in the formats users already have, as named state.

- a ``.safetensors`` file or a Hugging Face weights folder (:mod:`client.formats.importing`);
- a ``.pt`` / ``.pth`` / ``.bin`` file holding a state_dict, or a training checkpoint dict
  with its optimizer, scheduler, step, epoch and metrics (:mod:`client.formats.torch_dicts`),
  and a Lightning ``.ckpt``;
- a Hugging Face ``Trainer`` checkpoint folder (``trainer_state.json`` beside the weights):
  the weights, ``optimizer.pt`` with its state by position, ``scheduler.pt``, and
  ``trainer_state.json`` and ``rng_state*.pth`` as extras;
- a DCP checkpoint folder (``.metadata`` + ``*.distcp``): its ``model``, optimizer, scheduler,
  step and extras in ``get_state_dict``'s, torchtitan's or torchtune's layout
  (:mod:`client.formats.dcp_layouts`).

Every file is untrusted input, read by :mod:`client.formats` only: pickles by its allow-list
reader (never a general unpickler, never ``torch.load``), paths confined to the source folder,
every tensor checked against the bytes behind it (:func:`check_tensors`), and configs turned
into models without running code (:func:`meta_model`). Optimizer state is stored keyed by
parameter name where the source names the parameters (DCP's ``get_state_dict`` layout), and
by position where it numbers them (``Optimizer.state_dict()``): which parameter an index is,
only the optimizer that wrote it knew, so ``client.load(..., optim=...)`` pairs positions with
the optimizer it is given, as ``optimizer.load_state_dict`` does.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats import confined, lightning_ckpt
from ckptstore.client.formats.hf.model_configs import read_configs
from ckptstore.client.formats.json_text import large_integers, parse_json
from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.client.formats.torch_dicts import optimizer_state, read_layout
from ckptstore.client.formats.torch_save.constructors import RefusedTensor
from ckptstore.client.formats.torch_save.files import read_torch_file
from ckptstore.service.errors import InvalidInputError

PICKLED_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"
MAX_TRAINER_STATE_BYTES = 100 << 20
MAX_CONFIG_BYTES = 10 << 20
#: Most any integer in a config may be (a count of layers or heads, a size, a position, a token id),
#: whatever its key: a config class may make a list entry per layer before any model is built.
MAX_CONFIG_INT = 1 << 24
#: The model a config describes is built (on the meta device) to learn its names; it may register
#: this many parameters, buffers and submodules per tensor of the checkpoint's weights (transformers'
#: models register 2 to 3.5), plus :data:`SLACK_PARTS`, and never more than :data:`MAX_MODEL_PARTS`.
PARTS_PER_TENSOR = 8
SLACK_PARTS = 4096
MAX_MODEL_PARTS = 100_000


@dataclass
class Imported:
    """Named state read from a foreign checkpoint, and what of the source was not kept.

    ``tree`` is set for a source stored whole as a trainer plug-in stores its checkpoints
    (a Lightning ``.ckpt``): the dict with the weights under ``weights_key`` and everything
    else as extras; ``model`` then holds the same weights, for the report.
    """

    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: Each key of the source left out, with why (``"config": "a TrainingConfig, not JSON or tensors"``).
    left_out: dict[str, str] = field(default_factory=dict)
    tree: dict[str, Any] | None = None
    weights_key: str = "state_dict"

    def report(self) -> dict[str, Any]:
        """What the import stores and what it leaves out, as JSON (``ckptstore import --json``)."""
        optimizers = [self.optim] if self.optim is not None else []
        scheduler = self.scheduler is not None
        if self.tree is not None:  # a trainer's checkpoint: its optimizers and schedulers by position
            states = self.tree.get("optimizer_states")
            optimizers = [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []
            scheduler = bool(self.tree.get("lr_schedulers"))
        counts = [len(o["state"]) for o in optimizers if isinstance(o.get("state"), dict)]
        return {
            "model_tensors": len(self.model),
            "optimizer_parameters": sum(counts) if counts else None,
            "scheduler": scheduler,
            "step": self.step,
            "metrics": dict(self.metrics),
            "extra": sorted(self.extra) if self.tree is None else sorted(k for k in self.tree if k != self.weights_key),
            "left_out": dict(self.left_out),
        }


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling link or a FIFO included (the reader then refuses it by name)."""
    return os.path.lexists(path)


def check_tensors(value: Any, where: str) -> None:
    """Refuse a tensor anywhere in ``value`` that could not be made over its bytes, naming its path.

    ``value`` was measured by the pickle reader (bounded size and depth), so this walk is too; a
    node's path is spelled out only for the node refused (one string per node would cost the
    tree's size times its depth).
    """
    # (node, index of its parent's entry, the key or index that reached it)
    seen: list[tuple[Any, int, Any]] = [(value, -1, None)]
    stack = [0]
    while stack:
        at = stack.pop()
        node = seen[at][0]
        if isinstance(node, RefusedTensor):
            raise InvalidInputError(f"{_path_of(seen, at, where)}: {node.reason}")
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, (list, tuple)):
            children = enumerate(node)
        else:
            continue
        for key, child in children:
            if isinstance(child, (dict, list, tuple, RefusedTensor)):
                stack.append(len(seen))
                seen.append((child, at, key))


def _path_of(seen: list[tuple[Any, int, Any]], at: int, where: str) -> str:
    """``where`` followed by the keys from the root to entry ``at`` of :func:`check_tensors`'s walk."""
    keys = []
    while at > 0:
        _, at, key = seen[at]
        keys.append(f"[{key}]" if type(key) is int else f"[{shown(key)}]")
    return where + "".join(reversed(keys))


def tensor_bytes(imported: Imported) -> int:
    """The bytes of every tensor ``imported`` holds (what storing it hashes), a tensor met twice counted
    twice; an expanded (stride-0) tensor, which only ``--allow-expanded`` lets through, by its storage."""
    total = 0
    stack: list[Any] = (
        [imported.tree] if imported.tree is not None
        else [imported.model, imported.optim, imported.scheduler, imported.extra]
    )  # fmt: skip
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            expanded = node.numel() > 1 and 0 in node.stride()
            total += node.untyped_storage().nbytes() if expanded else node.nbytes
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def read_pickled_file(path: Path, *, expand_limit: int = 0) -> Imported:
    """A ``.pt``/``.pth``/``.bin`` state_dict or a Lightning ``.ckpt``.

    numpy scalars and arrays of plain numeric dtypes (``best_acc: np.float64(0.9)`` in older
    checkpoints) are read as data, never through numpy's own reconstructors, and kept as
    :func:`plain_values` makes them: scalars as numbers, arrays as tensors.
    """
    loaded = plain_values(read_torch_file(path, numpy_arrays=True, expand_limit=expand_limit))
    if lightning_ckpt.is_lightning_checkpoint(loaded):  # stored whole, as the Lightning plug-in stores one
        return Imported(**lightning_ckpt.lightning_fields(loaded, str(path)))
    layout = read_layout(loaded, str(path))
    return Imported(
        layout.model,
        optim=layout.optim,
        scheduler=plain_values(layout.scheduler),
        extra=plain_values(layout.extra),
        step=layout.step,
        metrics=layout.metrics,
        left_out=layout.left_out,
    )


def plain_values(value: Any) -> Any:
    """A tree with numpy arrays as tensors and numpy scalars as Python values (how extras are stored)."""
    if isinstance(value, dict):
        return {k: plain_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_values(v) for v in value)
    if type(value).__module__ == "numpy":
        import numpy

        if isinstance(value, numpy.ndarray):  # in native byte order and C order, as torch holds it
            return torch.from_numpy(numpy.ascontiguousarray(value, dtype=value.dtype.newbyteorder("=")).copy())
        return value.item()
    return value


def meta_model(directory: Path, weights: int) -> torch.nn.Module:
    """The transformers model ``config.json`` in ``directory`` describes, on the meta device
    (no memory, no download, no code from the folder), for a checkpoint of ``weights`` tensors.

    The config is read as JSON here and built with ``AutoConfig.for_model`` from its
    ``model_type``; a config that asks for remote code (``auto_map``) is refused, and the class
    is ``architectures[0]`` only when that names a transformers model class built for the
    config's type.

    What sizes the model is bounded without reading any field's name (a model has as many
    spellings of "layers" as it has authors): every integer in the config, nested ones included,
    is at most :data:`MAX_CONFIG_INT` before the config is built (config classes make a list
    entry per layer), and the build itself is stopped once it has registered more parameters,
    buffers and submodules than the checkpoint's own ``weights`` could account for
    (:func:`bounded_build`).
    """
    import transformers

    path = directory / "config.json"
    config_dict = parse_json(confined.read_small(path, MAX_CONFIG_BYTES), str(path), floats=True)
    if not isinstance(config_dict, dict):
        raise InvalidInputError(f"{path}: not a JSON object")
    if "auto_map" in config_dict:
        raise InvalidInputError(
            f"{path}: names its own model code (auto_map); ckptstore never runs remote code from a checkpoint"
        )
    large = large_integers(config_dict, MAX_CONFIG_INT)
    if large is not None:
        raise InvalidInputError(
            f"{path}: {large[0]} is {large[1]}, past the limit of {MAX_CONFIG_INT} for any number in a config "
            "(numbers in a config size the model that is built from it)"
        )
    model_type = config_dict.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise InvalidInputError(f"{path}: model_type {str(model_type)[:40]!r} is not one transformers knows")
    try:
        with _quiet():
            config = transformers.AutoConfig.for_model(model_type, **config_dict)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        raise InvalidInputError(f"{path}: transformers refuses the config: {str(exc)[:200]}") from exc
    architectures = config_dict.get("architectures") or []
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (
        isinstance(model_class, type)
        and issubclass(model_class, transformers.PreTrainedModel)
        and model_class.config_class is not None
        and isinstance(config, model_class.config_class)
    ):
        raise InvalidInputError(
            f"{path}: architectures names {str(name)[:80]!r}, not a transformers model class for a {model_type} config"
        )
    limit = min(PARTS_PER_TENSOR * weights + SLACK_PARTS, MAX_MODEL_PARTS)
    try:
        with torch.device("meta"), _quiet(), bounded_build(limit, f"{path}: {name}", weights):
            return model_class(config)
    except (TypeError, ValueError, AttributeError, KeyError, RuntimeError, IndexError, OverflowError) as exc:
        raise InvalidInputError(f"{path}: {name} cannot be built from this config: {str(exc)[:200]}") from exc


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' log records and Python warnings silenced: what they say of a foreign config
    quotes its strings, which reach the terminal as they are; a refusal says what matters."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextmanager
def bounded_build(limit: int, subject: str, weights: int) -> Iterator[None]:
    """In this context, this thread may register at most ``limit`` parameters, buffers and
    submodules on modules (torch's global registration hooks count them as they are made); the
    one past it raises, ending the build of a model larger than its checkpoint.

    Raises:
        InvalidInputError: naming ``subject``, the limit and the ``weights`` it was drawn from.
    """
    from torch.nn.modules import module as modules

    thread = threading.get_ident()
    registered = 0

    def count(*_: object) -> None:
        nonlocal registered
        if threading.get_ident() != thread:
            return
        registered += 1
        if registered > limit:
            raise InvalidInputError(
                f"{subject} has more than {limit} parameters, buffers and submodules, past the limit for a "
                f"checkpoint of {weights} tensors: the config describes a larger model than its weights"
            )

    handles = [
        modules.register_module_parameter_registration_hook(count),
        modules.register_module_buffer_registration_hook(count),
        modules.register_module_module_registration_hook(count),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def add_tied(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``tensors`` plus every tied name ``model`` has (``lm_head.weight`` for ``embed_tokens.weight``)
    that the saved weights leave out, as transformers' save_pretrained does."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    completed = dict(tensors)
    for names in groups.values():
        present = [n for n in names if n in tensors]
        for name in names:
            if present and name not in completed:
                completed[name] = tensors[present[0]]
    return completed


def read_trainer_folder(directory: Path, model_tensors: dict[str, torch.Tensor], *, expand_limit: int = 0) -> Imported:
    """A Trainer checkpoint folder: ``model_tensors`` (its weights, read by the caller) and the rest.

    ``extra`` holds ``trainer_state`` (``trainer_state.json``), ``model_config`` and
    ``generation_config`` (``config.json`` and ``generation_config.json``, which ``ckptstore export``
    writes back: :mod:`client.formats.hf.model_configs`) and ``rng_state``: each ``rng_state*.pth`` by file
    stem, in the Trainer's own layout (``python``, ``numpy``, ``cpu``, ``cuda``), as
    ``client.integrations.transformers.resume`` reads it.
    """
    state_path = directory / TRAINER_STATE
    trainer_state = parse_json(
        confined.read_small(state_path, MAX_TRAINER_STATE_BYTES), str(state_path), floats=True, constants=True
    )
    model = meta_model(directory, len(model_tensors))  # the config is checked here: parsed, built, no remote code
    configs = read_configs(directory)  # config.json, and generation_config.json where the folder has one
    imported = Imported(add_tied(model_tensors, model), extra={"trainer_state": trainer_state, **configs})
    step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    imported.step = step if isinstance(step, int) else None
    optimizer_path = directory / "optimizer.pt"
    if exists(optimizer_path):  # numbered by the Trainer's optimizer: kept by position (torch_dicts.optimizer_state)
        loaded = read_torch_file(optimizer_path, expand_limit=expand_limit)
        imported.optim = optimizer_state(loaded, imported.model, str(optimizer_path))
    if exists(directory / "scheduler.pt"):
        imported.scheduler = plain_values(read_torch_file(directory / "scheduler.pt", expand_limit=expand_limit))
    rng = {
        p.stem: plain_values(read_torch_file(p, numpy_arrays=True, expand_limit=expand_limit))
        for p in sorted(directory.glob("rng_state*.pth"))
    }
    if rng:
        imported.extra["rng_state"] = rng
    return imported
