"""Compare ckptstore's embedded store with safetensors, torch.save and torch.distributed.checkpoint.

Every method saves and loads the same transformer-shaped state in the same run. Saves are
durable (file and directory fsynced), loads are cold (page cache dropped before each one)
where the machine allows it, and each figure is the median of ``--repeats`` runs. Peak RSS of
every load is measured in a child process (this script re-invoked with ``--child``).

    .venv/bin/python bench/compare.py --quick
    .venv/bin/python bench/compare.py --size-gib 1 --json bench/results.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from client import Client
from service.format.sharding import DEFAULT_SHARD_BYTES

# The client reads this at every save/load, so setting it after the import is enough.
os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"

# DCP warns that it assumes a single process when torch.distributed is not initialised.
warnings.filterwarnings("ignore", message=".*single process.*")

RUN_ID = "bench"
PAGE = 4096
MIB = 1 << 20
GIB = 1 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Share of the model's parameters the LoRA adapters train (the rank is chosen to match it).
LORA_SHARE = 0.01
PROJECTIONS = ("q", "k", "v", "o")
LOAD = "load"
LOAD_INTO = "load_into_model"

# --------------------------------------------------------------------------------------
# The state being saved
# --------------------------------------------------------------------------------------


class Block(nn.Module):
    """One transformer block's parameters: attention projections, an MLP, two layernorms."""

    def __init__(self, d: int, **factory: Any) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d, **factory)
        self.q = nn.Linear(d, d, **factory)
        self.k = nn.Linear(d, d, **factory)
        self.v = nn.Linear(d, d, **factory)
        self.o = nn.Linear(d, d, **factory)
        self.ln2 = nn.LayerNorm(d, **factory)
        self.up = nn.Linear(d, 4 * d, **factory)
        self.down = nn.Linear(4 * d, d, **factory)


class Transformer(nn.Module):
    """An embedding, ``layers`` blocks and a final layernorm (state only: no forward needed)."""

    def __init__(self, vocab: int, d: int, layers: int, **factory: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, **factory)
        self.blocks = nn.ModuleList(Block(d, **factory) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, **factory)


@dataclass(frozen=True)
class Shape:
    """The model's dimensions and dtype."""

    vocab: int
    hidden: int
    layers: int
    dtype: str
    with_optimizer: bool

    def child_args(self) -> list[str]:
        """Command-line arguments that rebuild this shape in a child process."""
        args = ["--vocab", str(self.vocab), "--hidden", str(self.hidden), "--layers", str(self.layers)]
        args += ["--dtype", self.dtype]
        return args + (["--with-optimizer"] if self.with_optimizer else [])


def layers_for(size_bytes: float, vocab: int, d: int, dtype: torch.dtype) -> int:
    """The number of blocks that brings the model closest to ``size_bytes``."""
    item = torch.empty((), dtype=dtype).element_size()
    block = (4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d) * item
    fixed = (vocab * d + 2 * d) * item
    return max(1, round((size_bytes - fixed) / block))


def build_model(shape: Shape, fill: str) -> Transformer:
    """The model with memory allocated and written: ``fill`` is 'random' or 'zeros'."""
    with torch.device("meta"):
        model = Transformer(shape.vocab, shape.hidden, shape.layers, dtype=DTYPES[shape.dtype])
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if fill == "random":
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.zero_()
    return model


def fake_step(
    optim: torch.optim.Optimizer, params: Iterable[nn.Parameter], generator: torch.Generator | None = None
) -> None:
    """One optimizer step, so its state exists (or changes).

    With ``generator`` the gradients are random, so no two state tensors are equal and nothing
    deduplicates by accident; without, they are an expanded constant that allocates nothing
    (for load targets, whose values do not matter).
    """
    params = list(params)
    for param in params:
        if generator is None:
            param.grad = torch.full((), 1e-3, dtype=param.dtype).expand_as(param)
        else:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
    optim.step()
    for param in params:
        param.grad = None


def build_optimizer(
    model: nn.Module, shape: Shape, generator: torch.Generator | None = None
) -> torch.optim.Optimizer | None:
    """AdamW over the model after one step (see :func:`fake_step`), or None without ``--with-optimizer``."""
    if not shape.with_optimizer:
        return None
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fake_step(optim, model.parameters(), generator)
    return optim


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def optim_tensors(optim: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor of the optimizer's per-parameter state."""
    if optim is None:
        return []
    return [v for state in optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor a full checkpoint of ``model`` and ``optim`` holds."""
    return list(model.state_dict().values()) + optim_tensors(optim)


def touch(tensors: Iterable[torch.Tensor]) -> int:
    """Read one byte of every 4 KiB page of each tensor; returns a checksum of those bytes.

    Applied to the result of *every* load method alike. For loaders that map the file
    (safetensors.load_file, torch.load(mmap=True)) this is what actually reads the data from
    disk; for loaders that already copied into memory (ckptstore, DCP) it costs about a
    millisecond per GiB. So every timed load means "all bytes are in memory".
    """
    total = 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


def same_state(
    model: nn.Module, optim: torch.optim.Optimizer | None, ref: nn.Module, ref_optim: torch.optim.Optimizer | None
) -> bool:
    """True when ``model`` (and ``optim``) hold exactly the reference values."""
    if not same_tensors(model.state_dict(), ref):
        return False
    if optim is None or ref_optim is None:
        return optim is ref_optim
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        ours, theirs = optim.state[param], ref_optim.state[ref_param]
        if ours.keys() != theirs.keys() or not all(torch.equal(ours[k], theirs[k]) for k in ours):
            return False
    return True


def same_tensors(loaded: dict[str, torch.Tensor], ref: nn.Module) -> bool:
    """True when a loaded state_dict equals the reference model's."""
    expected = ref.state_dict()
    return loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)


# --------------------------------------------------------------------------------------
# Files: durability and cold reads
# --------------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (directories after their contents)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder, name))
        fsync_path(Path(folder))


def files_under(root: Path) -> list[Path]:
    """Every regular file under ``root``."""
    return [Path(folder, name) for folder, _, files in os.walk(root) for name in files]


def can_drop_caches() -> bool:
    """True when this process may write to /proc/sys/vm/drop_caches."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


class CacheDropper:
    """Makes the next read of some files come from disk: drop_caches if allowed, else fadvise."""

    def __init__(self) -> None:
        self.method = "drop_caches" if can_drop_caches() else "fadvise(DONTNEED)"

    def __call__(self, root: Path) -> None:
        """Evict ``root``'s files (or the whole page cache) after writing back dirty pages."""
        os.sync()
        if self.method == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as handle:
                handle.write("3\n")
            return
        for path in files_under(root):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def check_real_disk(path: Path) -> None:
    """Refuse a scratch folder on tmpfs/ramfs, where 'disk' numbers would be memory numbers."""
    best, fstype = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            mount_point, kind = line.split()[1:3]
            if str(path).startswith(mount_point.rstrip("/") + "/") and len(mount_point) > len(best):
                best, fstype = mount_point, kind
    if fstype in {"tmpfs", "ramfs"}:
        raise SystemExit(f"{path} is on {fstype}; pass --workdir on a real disk")


# --------------------------------------------------------------------------------------
# The methods compared
# --------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds taken by ``fn()`` and its result.

    A full garbage collection runs first (untimed), so no operation pays for a collection
    triggered by garbage that earlier ones left: in a process holding torch, a gen-2 pass takes
    0.2-0.5 s here, as long as a whole LoRA save.
    """
    gc.collect()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


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


#: Worker processes of the benchmarked server, as docker-compose.yml deploys the service.
SERVER_WORKERS = 2


@contextlib.contextmanager
def served(home: Path) -> Iterator[str]:
    """``ckptstore serve`` on ``home`` with SERVER_WORKERS uvicorn workers (httptools/uvloop); yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "CKPTSTORE_HOME": str(home), "CKPTSTORE_PORT": str(port)}
    env["CKPTSTORE_WORKERS"] = str(SERVER_WORKERS)
    env.pop("CKPTSTORE_URL", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # a benchmark harness may poll; the timed work starts once the server answers
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"ckptstore serve did not start on {url}") from None
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


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


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table."""

    method: str
    operation: str
    seconds: list[float]
    nbytes: int
    peak_rss_mib: float | None = None
    ratio: float | None = None
    note: str = ""

    @property
    def median(self) -> float:
        """Median of the timed runs."""
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        """Logical bytes moved per second, in GB/s (10^9 bytes)."""
        return self.nbytes / self.median / 1e9


@dataclass
class Bench:
    """Everything one benchmark run needs and produces."""

    shape: Shape
    repeats: int
    warmup: int
    workdir: Path
    model: nn.Module
    optim: torch.optim.Optimizer | None
    target: nn.Module
    target_optim: torch.optim.Optimizer | None
    dropper: CacheDropper
    model_bytes: int = 0
    total_bytes: int = 0
    rows: list[Row] = field(default_factory=list)
    lora: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Fixed now: the LoRA step adds adapters to the model later.
        self.model_bytes = tensor_bytes(self.model.state_dict().values())
        self.total_bytes = tensor_bytes(state_tensors(self.model, self.optim))

    def folder(self, method: Method) -> Path:
        """Where ``method`` keeps its checkpoint."""
        return self.workdir / method.name


def fresh_folder(path: Path) -> Path:
    """An empty folder at ``path`` (removing what was there)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def rounds(bench: Bench) -> Iterable[tuple[bool, list[Method]]]:
    """Per round: whether it is timed (warm-up rounds come first) and the order of the methods.

    Warm-up matters on VMs whose host backs guest memory lazily: the first pass over a
    gigabyte of fresh page cache or buffers can take several times longer than later ones.
    The order rotates every round so no method always runs right after the same other one.
    """
    for index in range(bench.warmup + bench.repeats):
        shift = index % len(METHODS)
        yield index >= bench.warmup, METHODS[shift:] + METHODS[:shift]


def time_saves(bench: Bench) -> None:
    """Median durable-save time per method; rounds interleave the methods."""
    seconds: dict[str, list[float]] = {m.name: [] for m in METHODS}
    for counted, order in rounds(bench):
        for method in order:
            path = fresh_folder(bench.folder(method))
            os.sync()
            elapsed = method.save(bench.model, bench.optim, path)
            if counted:
                seconds[method.name].append(elapsed)
    for method in METHODS:
        bench.rows.append(Row(method.name, "save", seconds[method.name], bench.total_bytes))


def time_loads(bench: Bench) -> None:
    """Median cold-load time per method and operation, checking every result."""
    seconds: dict[tuple[str, str], list[float]] = {}
    for counted, order in rounds(bench):
        for method in order:
            for operation in (LOAD, LOAD_INTO):
                elapsed = cold_load(bench, method, operation)
                if counted:
                    seconds.setdefault((method.name, operation), []).append(elapsed)
    for (name, operation), values in seconds.items():
        nbytes = bench.model_bytes if operation == LOAD else bench.total_bytes
        bench.rows.append(Row(name, operation, values, nbytes))


def cold_load(bench: Bench, method: Method, operation: str) -> float:
    """Seconds of one cold load by ``method``; exits if the loaded values are wrong."""
    path = bench.folder(method)
    if operation == LOAD:
        bench.dropper(path)
        elapsed, state = timed(lambda: method.load(path))
        correct = same_tensors(state, bench.model)
    else:
        zero_target(bench)
        bench.dropper(path)
        elapsed, _ = timed(lambda: method.load_into(path, bench.target, bench.target_optim))
        correct = same_state(bench.target, bench.target_optim, bench.model, bench.optim)
    if not correct:
        raise SystemExit(f"{method.name} {operation}: the loaded values differ from the saved ones")
    # A method that must start something first (a server) times its own load.
    return float(method.__dict__.pop("last_seconds", elapsed))


def zero_target(bench: Bench) -> None:
    """Overwrite the load target with zeros so a failed load cannot pass the check."""
    with torch.no_grad():
        for tensor in state_tensors(bench.target, bench.target_optim):
            tensor.zero_()


def child_peak_rss(bench: Bench, method: Method, operation: str) -> float:
    """Peak RSS above baseline (MiB) of one load, run in a fresh process."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", f"{method.name}:{operation}"]
    command += ["--child-path", str(bench.folder(method)), *bench.shape.child_args()]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {method.name}:{operation} failed:\n{done.stderr}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return (report["peak_kib"] - report["baseline_kib"]) / 1024


def measure_rss(bench: Bench) -> None:
    """Fill in the peak RSS column of every load row."""
    for row in bench.rows:
        if row.operation in (LOAD, LOAD_INTO):
            row.peak_rss_mib = child_peak_rss(bench, BY_NAME[row.method], row.operation)


# --------------------------------------------------------------------------------------
# LoRA-style second version
# --------------------------------------------------------------------------------------


def lora_rank(model: Transformer, share: float = LORA_SHARE) -> int:
    """The adapter rank whose A/B pairs on every attention projection train ``share`` of the model."""
    d = model.blocks[0].q.weight.shape[1]
    per_rank = len(model.blocks) * len(PROJECTIONS) * 2 * d
    return max(1, round(share * sum(p.numel() for p in model.parameters()) / per_rank))


def add_adapters(model: Transformer, rank: int) -> list[nn.Parameter]:
    """Freeze the model and give every attention projection a trainable rank-``rank`` A/B pair."""
    model.requires_grad_(False)
    adapters = []
    for block in model.blocks:
        for name in PROJECTIONS:
            weight = getattr(block, name).weight
            a = nn.Parameter(torch.randn(rank, weight.shape[1], dtype=weight.dtype) * 0.01)
            b = nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype))
            block.register_parameter(f"{name}_lora_A", a)
            block.register_parameter(f"{name}_lora_B", b)
            adapters += [a, b]
    return adapters


LORA_SAVES = {
    "save_lora_v2": "LoRA v2, same client (digest cache); GB/s and ratio over the full logical state",
    "save_lora_v2_new_client": "LoRA v2, new client (re-hashes the frozen base)",
    "save_lora_v2_resumed": "LoRA v2, resumed job: a new client loads the model, steps, saves",
}


def lora_round(bench: Bench, adapters: list[nn.Parameter], optim: torch.optim.Optimizer) -> dict[str, Any]:
    """One fresh store: a full save, an adapter-only change saved by the same client, another saved
    by a new client; returns ``name -> (seconds, SaveResult)``."""
    generator = torch.Generator().manual_seed(1)
    home = fresh_folder(bench.workdir / "lora")
    outcome = {}
    with Client(home=home) as client:
        for name in ("save_lora_v1", "save_lora_v2"):
            fake_step(optim, adapters, generator)
            os.sync()
            outcome[name] = timed(lambda: client.save(RUN_ID, bench.model, optim))
    fake_step(optim, adapters, generator)
    os.sync()
    with Client(home=home) as client:
        outcome["save_lora_v2_new_client"] = timed(lambda: client.save(RUN_ID, bench.model, optim))
    with Client(home=home) as client:  # as a resumed process: load (teaches the cache), step, save
        client.load(RUN_ID, model=bench.model, optim=optim)
        fake_step(optim, adapters, generator)
        os.sync()
        outcome["save_lora_v2_resumed"] = timed(lambda: client.save(RUN_ID, bench.model, optim))
        # The time a training loop waits for a background save, against a plain copy of what it
        # must not read live (the adapters and their optimizer state), each right after a step.
        # The first background save of a process also allocates its staging buffers; the loop
        # waits for that once, then for the copies into them.
        for name in ("lora_blocked_first", "lora_blocked"):
            fake_step(optim, adapters, generator)
            gc.collect()  # as timed() does
            started = time.perf_counter()
            handle = client.save(RUN_ID, bench.model, optim, blocking=False)
            outcome[name] = (time.perf_counter() - started, handle.result())
    fake_step(optim, adapters, generator)
    trainable = [*adapters, *optim_tensors(optim)]
    outcome["lora_plain_copy"] = timed(lambda: [t.clone() for t in trainable])
    return outcome


def time_lora(bench: Bench) -> None:
    """Freeze the base, add adapters, save (v1), change only the adapters, save again.

    The second save comes once from the same client, whose digest cache skips re-hashing the
    frozen base, and once from a new client (as a resumed process would), which re-hashes the
    base but still writes only what changed. The adapters' AdamW state is saved with them.
    """
    adapters = add_adapters(bench.model, lora_rank(bench.model))
    optim = torch.optim.AdamW(adapters, lr=1e-4)
    results = [lora_round(bench, adapters, optim) for _ in range(bench.repeats)]
    last = results[-1]
    total = last["save_lora_v1"][1].bytes_total
    bench.lora = {
        "adapter_bytes": tensor_bytes(adapters),
        "adapter_share": sum(a.numel() for a in adapters) / sum(p.numel() for p in bench.model.parameters()),
        "rank": adapters[0].shape[0],
        "bytes_total": total,
    }
    for name in last:
        bytes_new = getattr(last[name][1], "bytes_new", 0)  # a plain copy stores nothing
        bench.lora[name] = {"seconds": [r[name][0] for r in results], "bytes_new": bytes_new}
    for name, note in LORA_SAVES.items():
        bench.rows.append(Row("ckptstore", name, bench.lora[name]["seconds"], total, note=note))


# --------------------------------------------------------------------------------------
# A full save after every tensor changed
# --------------------------------------------------------------------------------------


ALL_CHANGED = "save_all_changed"


def nudge(model: nn.Module) -> None:
    """Change every floating-point tensor of ``model`` in place, as a step of full fine-tuning does."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.mul_(1.0 + 2.0**-10)


def all_changed_round(bench: Bench) -> tuple[float, Any]:
    """One fresh store: a full save, every tensor changed in place, the same client saves again."""
    home = fresh_folder(bench.workdir / "all-changed")
    with Client(home=home) as client:
        client.save(RUN_ID, bench.model)
        nudge(bench.model)
        os.sync()
        return timed(lambda: client.save(RUN_ID, bench.model))


def time_all_changed(bench: Bench) -> None:
    """The next save of a fully trained model: every tensor changed since the client's last save,
    so each goes to the store unhashed and is read once. Runs last: it changes the model."""
    results = [all_changed_round(bench) for _ in range(bench.repeats)]
    nbytes = results[-1][1].bytes_total
    note = "every tensor changed in place since the same client's last save (written unhashed)"
    bench.rows.append(Row("ckptstore", ALL_CHANGED, [seconds for seconds, _ in results], nbytes, note=note))


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def add_ratios(rows: list[Row]) -> None:
    """Each row's median time over safetensors' for the same operation (LoRA saves: vs full save)."""
    base = {row.operation: row.median for row in rows if row.method == "safetensors"}
    for row in rows:
        reference = base.get(row.operation) or base.get("save" if row.operation.startswith("save") else "")
        row.ratio = row.median / reference if reference else None


def run_text(command: list[str]) -> str:
    """A command's stripped output, or '' if it fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def code_commit(code: Path) -> str:
    """The short commit of the checkout holding ``code``, marked '+dirty' if tracked files differ."""
    commit = run_text(["git", "-C", str(code), "rev-parse", "--short", "HEAD"])
    if not commit:
        return "unknown"
    changed = run_text(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"])
    return commit + ("+dirty" if changed else "")


def fill_gbps(nbytes: int = 256 * MIB, tries: int = 3) -> tuple[float, float]:
    """Best GB/s of filling fresh memory (first touch, page faults) and of filling it again.

    On some VMs (e.g. with balloon free-page reporting) first touch is many times slower
    than memory bandwidth; every method that allocates memory or page cache pays it.
    """
    fresh = resident = 0.0
    for _ in range(tries):
        seconds, buffer = timed(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1))
        fresh = max(fresh, nbytes / seconds / 1e9)
        seconds, _ = timed(lambda buffer=buffer: buffer.fill_(2))
        resident = max(resident, nbytes / seconds / 1e9)
        del buffer
    return fresh, resident


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, library versions, commit and code location, first-touch cost."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    code = Path(sys.modules[Client.__module__].__file__ or ".").resolve().parent.parent
    commit = code_commit(code)
    fresh, resident = fill_gbps()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "commit": commit,
        "code": str(code),
        "fill_fresh_gbps": round(fresh, 2),
        "fill_resident_gbps": round(resident, 2),
    }


def format_table(rows: list[Row]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| method | operation | seconds (median) | min-max s | GB/s | vs safetensors | peak RSS MiB | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        rss = f"{row.peak_rss_mib:.0f}" if row.peak_rss_mib is not None else "-"
        spread = f"{min(row.seconds):.2f}-{max(row.seconds):.2f}"
        cells = [row.method, row.operation, f"{row.median:.3f}", spread, f"{row.gbps:.2f}", ratio, rss, row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_footer(bench: Bench, machine: dict[str, Any]) -> str:
    """Machine, state size, cache-drop method and the LoRA summary."""
    shape, lora = bench.shape, bench.lora
    full = next(r.median for r in bench.rows if r.method == "ckptstore" and r.operation == "save")
    v2, fresh = lora["save_lora_v2"], lora["save_lora_v2_new_client"]
    return "\n".join(
        [
            f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB RAM; "
            f"torch {machine['torch']}, safetensors {machine['safetensors']}, python {machine['python']}; "
            f"commit {machine['commit']}; ckptstore code from {machine['code']}; "
            f"memory fill {machine['fill_fresh_gbps']} GB/s fresh (page faults) "
            f"vs {machine['fill_resident_gbps']} GB/s resident",
            f"state: model {bench.model_bytes / GIB:.3f} GiB ({shape.layers} layers, d={shape.hidden}, "
            f"vocab={shape.vocab}, {shape.dtype}), optimizer {(bench.total_bytes - bench.model_bytes) / GIB:.3f} GiB; "
            f"median of {bench.repeats} after {bench.warmup} warm-up; cold reads via {bench.dropper.method}; "
            "GB/s = logical bytes / 1e9 / s",
            f"LoRA: rank {lora['rank']} on {', '.join(PROJECTIONS)}, {lora['adapter_share']:.2%} of the parameters "
            f"trainable, adapters {lora['adapter_bytes'] / MIB:.2f} MiB + AdamW state; "
            f"v2 wrote {v2['bytes_new'] / MIB:.2f} MiB of {lora['bytes_total'] / GIB:.3f} GiB and took "
            f"{statistics.median(v2['seconds']) / full:.3f}x the time of the first full save "
            f"({statistics.median(fresh['seconds']) / full:.3f}x from a new client); a background save blocked "
            f"the caller {statistics.median(lora['lora_blocked']['seconds']) * 1e3:.1f} ms "
            f"({statistics.median(lora['lora_blocked_first']['seconds']) * 1e3:.1f} ms for the first, which "
            "allocates the staging buffers) against "
            f"{statistics.median(lora['lora_plain_copy']['seconds']) * 1e3:.1f} ms for a plain clone of the "
            "trainable state",
            *all_changed_line(bench),
            *([floor_line(bench)] if any(r.operation == LOAD_INTO for r in bench.rows) else []),
        ]
    )


def all_changed_line(bench: Bench) -> list[str]:
    """The save after every tensor changed, against the first full save (none if not measured)."""
    t = {(r.method, r.operation): r.median for r in bench.rows}
    if ("ckptstore", ALL_CHANGED) not in t:
        return []
    full, again = t[("ckptstore", "save")], t[("ckptstore", ALL_CHANGED)]
    return [f"every tensor changed, same client: {again:.3f} s, {again / full:.2f}x the first full save ({full:.3f} s)"]


def floor_line(bench: Bench) -> str:
    """How close each method's load into a model comes to the device's raw read (raw-io)."""
    t = {(r.method, r.operation): r.median for r in bench.rows}
    floor = t[("raw-io", LOAD_INTO)]
    speeds = ", ".join(f"{m.name} {floor / t[(m.name, LOAD_INTO)]:.2f}x" for m in METHODS if m.name != "raw-io")
    return (
        f"I/O floor (raw-io: buffered write, no format, no hashing): save {t[('raw-io', 'save')]:.3f} s, "
        f"cold read into the model {floor:.3f} s; load-into-model speed as a share of it: {speeds}"
    )


@dataclass
class Target:
    """One performance target: a measured figure against its floor (and goal)."""

    what: str
    value: float
    floor: float
    goal: float | None = None
    at_most: bool = False  # True: the figure must stay at or below the floor

    @property
    def met(self) -> bool:
        """Whether the floor is met."""
        return self.value <= self.floor if self.at_most else self.value >= self.floor


def targets(bench: Bench) -> list[Target]:
    """The figures the benchmark is meant to keep in line, computed from this run's medians.

    Speeds are ratios of times (other's seconds / ours), so 1.25 means 1.25x as fast.
    """
    t = {(r.method, r.operation): r.median for r in bench.rows}
    rss = {(r.method, r.operation): r.peak_rss_mib for r in bench.rows}
    full = t[("ckptstore", "save")]
    save_targets = [
        Target("embedded save speed vs safetensors save_file+fsync", t[("safetensors", "save")] / full, 0.8, 1.0),
        Target(
            "LoRA v2 save time / first full save time (same client)",
            statistics.median(bench.lora["save_lora_v2"]["seconds"]) / full,
            0.10,
            at_most=True,
        ),
        Target(
            "resumed LoRA v2 save time / first full save time (new client after a load)",
            statistics.median(bench.lora["save_lora_v2_resumed"]["seconds"]) / full,
            0.10,
            at_most=True,
        ),
        Target(
            "LoRA caller blocked by a background save / first full save time",
            statistics.median(bench.lora["lora_blocked"]["seconds"]) / full,
            0.02,
            at_most=True,
        ),
        Target(
            "LoRA caller blocked by a background save / plain clone of the trainable state",
            statistics.median(bench.lora["lora_blocked"]["seconds"])
            / statistics.median(bench.lora["lora_plain_copy"]["seconds"]),
            1.5,
            at_most=True,
        ),
        Target("HTTP save speed vs embedded", full / t[("ckptstore-http", "save")], 0.6, 0.8),
    ]
    if ("ckptstore", LOAD_INTO) not in t:  # --skip-loads
        return save_targets
    found = [
        save_targets[0],
        Target(
            "embedded load-into-model speed vs safetensors load_file",
            t[("safetensors", LOAD)] / t[("ckptstore", LOAD_INTO)],
            0.8,
            1.0,
        ),
        Target(
            "embedded load-into-model speed vs DCP FileSystemReader into the model",
            t[("dcp", LOAD_INTO)] / t[("ckptstore", LOAD_INTO)],
            1.5,
        ),
        *save_targets[1:],
    ]
    for operation in (LOAD, LOAD_INTO):
        found.append(
            Target(
                f"HTTP {operation} speed vs embedded",
                t[("ckptstore", operation)] / t[("ckptstore-http", operation)],
                0.6,
                0.8,
            )
        )
    peak = rss.get(("ckptstore", LOAD_INTO))
    if peak is not None:
        # The child's baseline already holds the model, so what the load may add is one shard plus
        # 15% of model + shard.
        allowed = (DEFAULT_SHARD_BYTES + 0.15 * (bench.total_bytes + DEFAULT_SHARD_BYTES)) / MIB
        found.append(Target("load-into-model peak RSS above the model, MiB", peak, allowed, at_most=True))
    return found


def format_targets(found: list[Target]) -> str:
    """The targets as a Markdown table."""
    lines = ["| target | this run | floor | goal | met |", "|---|---:|---:|---:|---|"]
    for target in found:
        floor = ("<= " if target.at_most else ">= ") + f"{target.floor:.2f}"
        goal = f"{target.goal:.2f}" if target.goal is not None else "-"
        lines.append(f"| {target.what} | {target.value:.2f} | {floor} | {goal} | {'yes' if target.met else 'NO'} |")
    return "\n".join(lines)


def write_json(path: Path, bench: Bench, machine: dict[str, Any]) -> None:
    """The results as JSON for tracking over time."""
    rows = [{**asdict(row), "median": row.median, "gbps": row.gbps} for row in bench.rows]
    document = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "shape": asdict(bench.shape),
        "model_bytes": bench.model_bytes,
        "total_bytes": bench.total_bytes,
        "repeats": bench.repeats,
        "warmup": bench.warmup,
        "cache_drop": bench.dropper.method,
        "rows": rows,
        "lora": bench.lora,
        "targets": [{**asdict(t), "met": t.met} for t in targets(bench)],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# Child process: one load, peak RSS
# --------------------------------------------------------------------------------------


def status_kib(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def run_child(args: argparse.Namespace, shape: Shape) -> None:
    """Perform one load and print its peak and baseline RSS as JSON.

    The baseline is taken after imports and, for loads into a model, after building and
    writing the model (and optimizer) that the load fills.
    """
    name, operation = args.child.split(":")
    method, path = BY_NAME[name], Path(args.child_path)
    target = optim = None
    if operation == LOAD_INTO:
        target = build_model(shape, "zeros")
        optim = build_optimizer(target, shape)
    reset = reset_peak_rss()
    baseline = status_kib("VmRSS")
    if operation == LOAD_INTO:
        assert target is not None
        method.load_into(path, target, optim)
    else:
        method.load(path)
    peak = status_kib("VmHWM") if reset else max(status_kib("VmHWM"), baseline)
    print(json.dumps({"peak_kib": peak, "baseline_kib": baseline, "hwm_reset": reset}))


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=None, help="model size (default 1.0; 1/16 with --quick)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size d (default 1024; 512 with --quick)")
    parser.add_argument("--vocab", type=int, default=None, help="embedding rows (default 32000; 8192 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (default: picked from --size-gib)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--with-optimizer", action="store_true", help="also save/load AdamW state after one step")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1; 0 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: 64 MiB, d=512, one repeat")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch folder parent (default: a temp dir on /work)"
    )
    parser.add_argument(
        "--skip-loads", action="store_true", help="time only the saves and the LoRA version (large or wide models)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.size_gib = args.size_gib if args.size_gib is not None else (1 / 16 if quick else 1.0)
    args.hidden = args.hidden or (512 if quick else 1024)
    args.vocab = args.vocab or (8192 if quick else 32000)
    args.repeats = args.repeats or (1 if quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if quick else 1)
    return args


def shape_from(args: argparse.Namespace) -> Shape:
    """The model shape the options describe."""
    dtype = DTYPES[args.dtype]
    layers = args.layers or layers_for(args.size_gib * GIB, args.vocab, args.hidden, dtype)
    return Shape(args.vocab, args.hidden, layers, args.dtype, args.with_optimizer)


def scratch_dir(parent: Path | None) -> Path:
    """A new scratch folder on a real disk: under ``parent``, else /work, else the temp dir."""
    if parent is None:
        parent = Path("/work") if os.access("/work", os.W_OK) else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ckptstore-bench-", dir=parent)).resolve()
    check_real_disk(path)
    return path


def row_order(row: Row) -> tuple[int, str, int]:
    """Table order: operations in a fixed order, safetensors first, then the METHODS order."""
    operations = ["save", LOAD, LOAD_INTO]
    rank = operations.index(row.operation) if row.operation in operations else len(operations)
    return (rank, row.operation, [m.name for m in METHODS].index(row.method))


def run_bench(args: argparse.Namespace, shape: Shape) -> Bench:
    """Build the state, time every method, measure RSS and the LoRA version; cleans up."""
    model = build_model(shape, "random")
    target = build_model(shape, "zeros")
    workdir = scratch_dir(args.workdir)
    bench = Bench(
        shape=shape,
        repeats=args.repeats,
        warmup=args.warmup,
        workdir=workdir,
        model=model,
        optim=build_optimizer(model, shape, torch.Generator().manual_seed(0)),
        target=target,
        target_optim=build_optimizer(target, shape),
        dropper=CacheDropper(),
    )
    try:
        print(
            f"state {bench.total_bytes / GIB:.3f} GiB in {workdir}; cold reads via {bench.dropper.method}",
            file=sys.stderr,
        )
        phases = (time_saves, time_lora) if args.skip_loads else (time_saves, time_loads, measure_rss, time_lora)
        phases += (time_all_changed,)
        for phase in phases:
            print(f"{time.strftime('%H:%M:%S')} {phase.__name__}", file=sys.stderr, flush=True)
            phase(bench)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    bench.rows.sort(key=row_order)
    add_ratios(bench.rows)
    return bench


def main(argv: list[str] | None = None) -> None:
    """Run the comparison (or, with --child, one measured load)."""
    args = parse_args(argv)
    shape = shape_from(args)
    if args.child:
        run_child(args, shape)
        return
    machine = machine_info()
    bench = run_bench(args, shape)
    print(format_table(bench.rows))
    print()
    print(format_footer(bench, machine))
    print()
    print(format_targets(targets(bench)))
    if args.json is not None:
        write_json(args.json, bench, machine)


if __name__ == "__main__":
    main()
