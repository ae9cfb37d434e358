"""Valid checkpoints of each format ``ckptstore import`` reads, written by the real libraries
(``torch.save``, ``dcp.save``, ``save_pretrained``, ``safetensors``), and the means to edit a DCP
checkpoint's metadata: what the hostile corpus (:mod:`tests.cli.hostile_imports`) mutates."""

from __future__ import annotations

import dataclasses
import json
import pickle  # noqa: TID251 - re-pickling DCP metadata the kit itself wrote by dcp.save
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.cli import hostile_pickles as hp


def model_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(16, generator=generator), "b": torch.randn(2, 3, generator=generator)}


def dcp_folder(folder: Path, extra: dict[str, Any] | None = None) -> Path:
    """A DCP checkpoint of :func:`model_state` (``__0_0.distcp`` + ``.metadata``) written by ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {"model": model_state()}
    if extra is not None:
        state["extra"] = extra
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


def trainer_folder(
    folder: Path, optimizer: Callable[[dict[str, Any]], dict[str, Any]] = lambda s: s
) -> torch.nn.Module:
    """A Trainer checkpoint folder: the weights, ``optimizer.pt`` in the Trainer's param grouping after
    one AdamW step (passed through ``optimizer`` before it is saved), ``scheduler.pt``,
    ``rng_state.pth`` and ``trainer_state.json``."""
    import numpy
    import transformers

    from tests.integrations.hf_kit import tiny_gpt2

    model = tiny_gpt2(seed=0)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if n in decay]},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=1e-3)
    for _, param in named:
        param.grad = torch.ones_like(param)
    optim.step()
    model.save_pretrained(folder)  # config.json, model.safetensors: the weights after the step
    scheduler = torch.optim.lr_scheduler.LinearLR(optim)
    hp.torch_saved(optimizer(optim.state_dict()), folder / "optimizer.pt")
    hp.torch_saved(scheduler.state_dict(), folder / "scheduler.pt")
    rng = {"python": random.Random(0).getstate(), "numpy": numpy.random.RandomState(0).get_state()}
    hp.torch_saved({**rng, "cpu": torch.Generator().manual_seed(0).get_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    return model


def _file(build: Callable[[Path], object], name: str) -> Callable[[Path], tuple[Path, dict[str, torch.Tensor]]]:
    def make(work: Path) -> tuple[Path, dict[str, torch.Tensor]]:
        build(work / name)
        return work / name, model_state()

    return make


def _folder(build: Callable[[Path], object]) -> Callable[[Path], tuple[Path, dict[str, torch.Tensor]]]:
    def make(work: Path) -> tuple[Path, dict[str, torch.Tensor]]:
        made = build(work / "ckpt")
        state = made.state_dict() if isinstance(made, torch.nn.Module) else model_state()
        return work / "ckpt", {k: v.detach().clone() for k, v in state.items()}

    return make


def _in_folder(name: str, build: Callable[[Path], object]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        folder.mkdir()
        build(folder / name)

    return make


#: One valid checkpoint per format: ``make(work) -> (source, the model tensors it holds)``.
BASES: dict[str, Callable[[Path], tuple[Path, dict[str, torch.Tensor]]]] = {
    "safetensors": _file(lambda p: save_file(model_state(), p), "model.safetensors"),
    "hf-folder": _folder(_in_folder("model.safetensors", lambda p: save_file(model_state(), p))),
    "pt": _file(lambda p: hp.torch_saved(model_state(), p), "weights.pt"),
    "pt-legacy": _file(lambda p: hp.torch_saved(model_state(), p, legacy=True), "weights.pt"),
    "ckpt": _file(lambda p: hp.torch_saved({"state_dict": model_state(), "global_step": 3}, p), "last.ckpt"),
    "bin-folder": _folder(_in_folder("pytorch_model.bin", lambda p: hp.torch_saved(model_state(), p))),
    "dcp": _folder(lambda p: dcp_folder(p, extra={"note": "hello", "epoch": 3})),
    "trainer": _folder(trainer_folder),
}


@contextmanager
def metadata_of(folder: Path) -> Iterator[Any]:
    """The ``Metadata`` this kit wrote by dcp.save into ``folder``, re-pickled after the caller mutates it."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # noqa: S301, TID251 - the kit's own dcp.save output
    yield metadata
    path.write_bytes(pickle.dumps(metadata))  # noqa: TID251 - making the hostile file under test


def storage_key(metadata: Any, fqn: str) -> Any:
    return next(key for key in metadata.storage_data if key.fqn == fqn)


def point(metadata: Any, fqn: str, **changes: Any) -> None:
    """Change the ``_StorageInfo`` (path, offset, length) of ``fqn``'s first chunk."""
    key = storage_key(metadata, fqn)
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **changes)
