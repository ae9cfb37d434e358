"""The methods bench/compare.py times: ckptstore (embedded and over HTTP) and the formats it is
measured against, each with a durable save, a load as a new state_dict and a load into a model.

safetensors, torch.save and torch.distributed.checkpoint as their users call them, and a raw
write/read of the same bytes with no format and no hashing: the plain I/O floor.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from common import RUN_ID, fsync_path, fsync_tree, optim_tensors, served, state_tensors, timed, touch
from torch import nn

from ckptstore.client import Client


class Method:
    """A checkpoint format: durable save, load as a new state_dict, load into a model."""

    name = ""

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        """Save durably into the empty folder ``path``; returns the seconds taken."""
        raise NotImplementedError

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        """The model's tensors as a new state_dict, every page read."""
        raise NotImplementedError

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        """Load into an existing model (and optimizer), every page read."""
        raise NotImplementedError


class Ckptstore(Method):
    """ckptstore's embedded store (SQLite + a local folder) through the public Client.

    A save is timed as a training loop pays it: ``client.save`` on an already open client
    (the store's folder and SQLite schema are created before the clock starts). A load is
    timed as a resumed process pays it: opening the client, then ``client.load``.
    """

    name = "ckptstore"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        with Client(home=path) as client:
            seconds, _ = timed(lambda: client.save(RUN_ID, model, optim))
        return seconds

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        with Client(home=path) as client:
            state = client.load(RUN_ID).state_dict
        assert state is not None
        touch(state.values())
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        with Client(home=path) as client:
            client.load(RUN_ID, model=model, optim=optim)
        touch(state_tensors(model, optim))


class CkptstoreHttp(Ckptstore):
    """ckptstore through its HTTP API: a ``ckptstore serve`` process on loopback over the same
    embedded store layout, and the client's HTTP transport. Server start-up is not timed."""

    name = "ckptstore-http"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        with served(path) as url, Client(url) as client:
            seconds, _ = timed(lambda: client.save(RUN_ID, model, optim))
        return seconds

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        with served(path) as url:
            started = time.perf_counter()
            with Client(url) as client:
                state = client.load(RUN_ID).state_dict
            assert state is not None
            touch(state.values())
            self.last_seconds = time.perf_counter() - started
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        with served(path) as url:
            started = time.perf_counter()
            with Client(url) as client:
                client.load(RUN_ID, model=model, optim=optim)
            touch(state_tensors(model, optim))
            self.last_seconds = time.perf_counter() - started


class Safetensors(Method):
    """safetensors.torch.save_file / load_file; optimizer tensors as ``optim.<index>.<name>``."""

    name = "safetensors"

    @staticmethod
    def _file(path: Path) -> Path:
        return path / "model.safetensors"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        def work() -> None:
            tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
            metadata = {}
            if optim is not None:
                saved = optim.state_dict()
                for index, state in saved["state"].items():
                    tensors.update({f"optim.{index}.{k}": v for k, v in state.items()})
                metadata["param_groups"] = json.dumps(saved["param_groups"])
            safetensors.torch.save_file(tensors, self._file(path), metadata=metadata)
            fsync_path(self._file(path))
            fsync_path(path)

        return timed(work)[0]

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        with safetensors.safe_open(self._file(path), framework="pt") as handle:
            keys = [k for k in handle.keys() if k.startswith("model.")]
            everything = len(keys) == len(handle.keys())
        if everything:
            loaded = safetensors.torch.load_file(self._file(path))
        else:  # load_file's own loop, restricted to the model's tensors
            with safetensors.safe_open(self._file(path), framework="pt") as handle:
                loaded = {k: handle.get_tensor(k) for k in keys}
        state = {k.removeprefix("model."): v for k, v in loaded.items()}
        touch(state.values())
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        loaded = safetensors.torch.load_file(self._file(path))
        model.load_state_dict({k.removeprefix("model."): v for k, v in loaded.items() if k.startswith("model.")})
        if optim is not None:
            with safetensors.safe_open(self._file(path), framework="pt") as handle:
                groups = json.loads(handle.metadata()["param_groups"])
            state: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in loaded.items():
                if key.startswith("optim."):
                    _, index, name = key.split(".", 2)
                    state.setdefault(int(index), {})[name] = value
            optim.load_state_dict({"state": state, "param_groups": groups})
        touch(state_tensors(model, optim))


class TorchSave(Method):
    """torch.save into an fsynced file / torch.load(mmap=True, weights_only=True)."""

    name = "torch.save"

    @staticmethod
    def _file(path: Path) -> Path:
        return path / "checkpoint.pt"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        def work() -> None:
            payload: dict[str, Any] = {"model": model.state_dict()}
            if optim is not None:
                payload["optim"] = optim.state_dict()
            with open(self._file(path), "wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_path(path)

        return timed(work)[0]

    def _open(self, path: Path) -> dict[str, Any]:
        return torch.load(self._file(path), mmap=True, weights_only=True)

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        state = self._open(path)["model"]
        touch(state.values())
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        payload = self._open(path)
        model.load_state_dict(payload["model"])
        if optim is not None:
            optim.load_state_dict(payload["optim"])
        touch(state_tensors(model, optim))


class DistributedCheckpoint(Method):
    """torch.distributed.checkpoint FileSystemWriter/Reader in single-process mode.

    DCP loads in place, so ``load`` first allocates empty tensors from DCP's metadata.
    """

    name = "dcp"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        def work() -> None:
            state: dict[str, Any] = {"model": model.state_dict()}
            if optim is not None:
                state["optim"] = optim.state_dict()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
            fsync_tree(path)  # the writer fsyncs its data files; make metadata and folder durable too

        return timed(work)[0]

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state = {
            key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith("model.")
        }
        dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(path))
        touch(state.values())
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        state: dict[str, Any] = {"model": model.state_dict()}
        if optim is not None:
            state["optim"] = optim.state_dict()
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        if optim is not None:
            optim.load_state_dict(state["optim"])
        touch(state_tensors(model, optim))


class RawIO(Method):
    """The plain I/O floor, not a format: every tensor's bytes back to back in one file, written
    (buffered, through the page cache, as every other method here writes) and fsynced, then read
    with ``preadv`` straight into the destination tensors. No header beyond a JSON index, no
    hashing: what a format writing through the page cache pays at least. ckptstore's direct
    writes skip the page cache and can beat this save."""

    name = "raw-io"

    def save(self, model: nn.Module, optim: torch.optim.Optimizer | None, path: Path) -> float:
        def work() -> None:
            named = [(f"model.{k}", v) for k, v in model.state_dict().items()]
            named += [(f"optim.{i}", v) for i, v in enumerate(optim_tensors(optim))]
            index, offset = [], 0
            with open(path / "data.bin", "wb") as handle:
                for name, tensor in named:
                    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    handle.write(data)
                    index.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
                    offset += data.nbytes
                handle.flush()
                os.fsync(handle.fileno())
            (path / "index.json").write_text(json.dumps(index))
            fsync_path(path / "index.json")
            fsync_path(path)

        return timed(work)[0]

    @staticmethod
    def _read(path: Path, targets: list[tuple[torch.Tensor, int]]) -> None:
        fd = os.open(path / "data.bin", os.O_RDONLY)
        try:
            for tensor, offset in targets:
                view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    count = os.preadv(fd, [view[done:]], offset + done)
                    if count == 0:
                        raise RuntimeError("data.bin is truncated")
                    done += count
        finally:
            os.close(fd)

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        index = json.loads((path / "index.json").read_text())
        state = {
            name.removeprefix("model."): torch.empty(shape, dtype=getattr(torch, dtype))
            for name, dtype, shape, _ in index
            if name.startswith("model.")
        }
        offsets = [offset for name, _, _, offset in index if name.startswith("model.")]
        self._read(path, list(zip(state.values(), offsets, strict=True)))
        touch(state.values())
        return state

    def load_into(self, path: Path, model: nn.Module, optim: torch.optim.Optimizer | None) -> None:
        index = json.loads((path / "index.json").read_text())
        targets = state_tensors(model, optim)
        self._read(path, list(zip(targets, [entry[3] for entry in index], strict=True)))
        touch(targets)


METHODS: list[Method] = [Safetensors(), Ckptstore(), CkptstoreHttp(), TorchSave(), DistributedCheckpoint(), RawIO()]
BY_NAME = {m.name: m for m in METHODS}
