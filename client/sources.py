"""What ``ckptstore import`` reads: checkpoints in the formats users already have, as named state.

- a ``.safetensors`` file or a Hugging Face weights folder (:mod:`client.importing`);
- a ``.pt`` / ``.pth`` / ``.bin`` file holding a state_dict (or a dict with one under
  ``state_dict``, ``model_state_dict`` or ``model``), and a Lightning ``.ckpt`` (its
  ``state_dict``; ``global_step`` becomes the version's step);
- a Hugging Face ``Trainer`` checkpoint folder (``trainer_state.json`` beside the weights):
  the weights, ``optimizer.pt`` with its state named by parameter, ``scheduler.pt``, and
  ``trainer_state.json`` and ``rng_state*.pth`` as extras;
- a DCP checkpoint folder (``.metadata`` + ``*.distcp``): its ``model`` and, when saved in
  ``get_state_dict``'s layout (state keyed by parameter name), its ``optim``, plus
  ``scheduler`` and ``extra`` if present.

Pickled files are read by :mod:`client.pickled` only (``weights_only``; never a full unpickler).
Optimizer state is always stored keyed by parameter name, so ``client.load(..., optim=...)``
resumes an imported run with the usual placement rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from client.pickled import load_weights_only, read_dcp_folder
from service.errors import InvalidInputError

PICKLED_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"
_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")
MAX_TRAINER_STATE_BYTES = 100 << 20


@dataclass
class Imported:
    """Named state read from a foreign checkpoint."""

    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    step: int | None = None


def _tensor_dict(value: Any, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(value, dict) or not value:
        raise InvalidInputError(f"{where} is not a non-empty dict of tensors")
    bad = [str(k)[:80] for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise InvalidInputError(f"{where} holds entries that are not tensors under names: {bad[:5]}")
    return value


def _state_dict_in(loaded: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model state_dict inside an object read from a pickled file."""
    if isinstance(loaded, dict) and loaded and all(isinstance(v, torch.Tensor) for v in loaded.values()):
        return _tensor_dict(loaded, str(path))
    if isinstance(loaded, dict):
        for key in _STATE_DICT_KEYS:
            if key in loaded:
                return _tensor_dict(loaded[key], f"{path}[{key!r}]")
        keys = [str(k)[:40] for k in loaded][:10]
        raise InvalidInputError(
            f"{path} holds a dict with keys {keys}, none of which is a state_dict {_STATE_DICT_KEYS}"
        )
    raise InvalidInputError(f"{path} holds a {type(loaded).__name__}, not a state_dict")


def read_pickled_file(path: Path) -> Imported:
    """A ``.pt``/``.pth``/``.bin`` state_dict or a Lightning ``.ckpt``."""
    loaded = load_weights_only(path)
    step = loaded.get("global_step") if isinstance(loaded, dict) else None
    return Imported(_state_dict_in(loaded, path), step=step if isinstance(step, int) else None)


def plain_values(value: Any) -> Any:
    """A tree with numpy arrays as tensors and numpy scalars as Python values (how extras are stored)."""
    if isinstance(value, dict):
        return {k: plain_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_values(v) for v in value)
    if type(value).__module__ == "numpy":
        import numpy

        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value.copy())
        return value.item()
    return value


def _named_optimizer(state: Any, names: list[list[str]], where: str) -> dict[str, Any]:
    """An index-keyed optimizer state_dict re-keyed by parameter name, checking every state tensor's shape."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or len(groups) != len(names):
        raise InvalidInputError(
            f"{where} has {len(groups or [])} param groups; the model's Trainer grouping has {len(names)}"
        )
    by_index: dict[int, str] = {}
    named_groups = []
    for group, group_names in zip(groups, names, strict=True):
        if len(group["params"]) != len(group_names):
            raise InvalidInputError(
                f"{where}: a param group holds {len(group['params'])} parameters, the model's Trainer grouping "
                f"{len(group_names)}"
            )
        by_index.update(zip(group["params"], group_names, strict=True))
        named_groups.append({**group, "params": group_names})
    return {"state": {by_index[i]: s for i, s in state["state"].items()}, "param_groups": named_groups}


def meta_model(directory: Path) -> torch.nn.Module:
    """The transformers model ``config.json`` in ``directory`` describes, on the meta device
    (no memory, no download)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise InvalidInputError(f"{directory}/config.json names no transformers architecture ({architectures})")
    with torch.device("meta"):
        return model_class(config)


def trainer_param_names(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of each param group ``transformers.Trainer`` builds for ``model``:
    the weight-decay group, then the rest."""
    import transformers

    # The Trainer's own rule (an instance method that reads nothing from the instance).
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in named if n in decay], [n for n in named if n not in decay]]


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


def read_trainer_folder(directory: Path, model_tensors: dict[str, torch.Tensor]) -> Imported:
    """A Trainer checkpoint folder: ``model_tensors`` (its weights, read by the caller) and the rest."""
    state_path = directory / TRAINER_STATE
    if state_path.stat().st_size > MAX_TRAINER_STATE_BYTES:
        raise InvalidInputError(f"{state_path} is larger than {MAX_TRAINER_STATE_BYTES} bytes")
    try:
        trainer_state = json.loads(state_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"{state_path} is not JSON: {exc}") from exc
    model = meta_model(directory)
    imported = Imported(add_tied(model_tensors, model), extra={"trainer_state": trainer_state})
    step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    imported.step = step if isinstance(step, int) else None
    if (directory / "optimizer.pt").is_file():
        names = trainer_param_names(model)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        optim = _named_optimizer(load_weights_only(directory / "optimizer.pt"), names, str(directory / "optimizer.pt"))
        for name, param_state in optim["state"].items():
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shapes[name]:
                    raise InvalidInputError(
                        f"optimizer.pt: {key} of {name!r} has shape {list(value.shape)}, the parameter "
                        f"{list(shapes[name])}; the optimizer was not built with the Trainer's grouping"
                    )
        imported.optim = optim
    if (directory / "scheduler.pt").is_file():
        imported.scheduler = plain_values(load_weights_only(directory / "scheduler.pt"))
    rng = {
        p.stem: plain_values(load_weights_only(p, numpy_arrays=True)) for p in sorted(directory.glob("rng_state*.pth"))
    }
    if rng:
        imported.extra["rng_state"] = rng
    return imported


def _by_name(optim: Any) -> bool:
    """Whether an optimizer state_dict is keyed by parameter name (``get_state_dict``'s layout)."""
    return (
        isinstance(optim, dict)
        and isinstance(optim.get("state"), dict)
        and isinstance(optim.get("param_groups"), list)
        and all(isinstance(k, str) for k in optim["state"])
        and all(isinstance(n, str) for g in optim["param_groups"] for n in g.get("params", []))
    )


def read_dcp(directory: Path) -> Imported:
    """A DCP checkpoint folder saved with a ``model`` entry (as ``get_state_dict`` gives it)."""
    state = read_dcp_folder(directory)
    if "model" not in state:
        raise InvalidInputError(
            f"{directory} is a DCP checkpoint without a 'model' entry (it holds {sorted(state)[:10]}); "
            "save {'model': model_state_dict, 'optim': optim_state_dict} as get_state_dict gives them"
        )
    imported = Imported(_tensor_dict(state.pop("model"), f"{directory} 'model'"))
    if "optim" in state:
        if not _by_name(state["optim"]):
            raise InvalidInputError(
                f"{directory}: its 'optim' is not keyed by parameter name; save it through get_state_dict"
            )
        imported.optim = state.pop("optim")
    imported.scheduler = state.pop("scheduler", None)
    extra = state.pop("extra", {})
    imported.extra = {**(extra if isinstance(extra, dict) else {"extra": extra}), **state}
    return imported
