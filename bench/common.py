"""What bench/compare.py's measurements share, and what other bench scripts borrow from it.

The transformer-shaped state every method saves and loads (and checks), durable writes and cold
reads of files, a scratch folder on a real disk, the timer every figure goes through, a loopback
``ckptstore serve``, and the rows and run state the sections fill in. Importing it turns the
client's progress bars off and silences DCP's single-process warning.
"""

from __future__ import annotations

import contextlib
import gc
import os
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The client reads this at every save/load, not at import: every script importing this module runs without bars.
os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"

# DCP warns that it assumes a single process when torch.distributed is not initialised.
warnings.filterwarnings("ignore", message=".*single process.*")

RUN_ID = "bench"
PAGE = 4096
MIB = 1 << 20
GIB = 1 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: The two load operations timed: a new state_dict, and into an existing model (and optimizer).
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


def fresh_folder(path: Path) -> Path:
    """An empty folder at ``path`` (removing what was there)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def scratch_dir(parent: Path | None) -> Path:
    """A new scratch folder on a real disk: under ``parent``, else /work, else the temp dir."""
    if parent is None:
        parent = Path("/work") if os.access("/work", os.W_OK) else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ckptstore-bench-", dir=parent)).resolve()
    check_real_disk(path)
    return path


# --------------------------------------------------------------------------------------
# Timing, and a server to time against
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
        [sys.executable, "-m", "ckptstore.client.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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


# --------------------------------------------------------------------------------------
# Results and the state of one run
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

    def folder(self, method: str) -> Path:
        """Where the method named ``method`` keeps its checkpoint."""
        return self.workdir / method
