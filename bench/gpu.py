"""The GPU data path: a state held in GPU memory saved and loaded back, and checkpoints while training.

One run prints two tables, every figure from the same process:

1. A bf16 state of many tensors in CUDA memory (2 GiB, 128 tensors) saved durably (files and
   folders fsynced) and loaded back onto the GPU, cold (``os.sync()``, then
   ``posix_fadvise(DONTNEED)`` on every file of the checkpoint: no root needed) and warm (right
   after the cold load): safetensors (``save_file`` / ``load_file(device=)``), fastsafetensors
   when importable (``ParallelSaver(fsync=True)`` / ``fastsafe_open(nogds=True)``), ``torch.save``
   / ``torch.load(mmap=True, map_location=)``, DCP (``no_dist=True``, loading in place) and
   ckptstore's embedded store (the first save into a fresh store; a load into the same module on
   the GPU, opening the client included). Floors: ``dd`` of ckptstore's shard files, all at
   once, cold; a pinned host-to-device (and device-to-host) copy of the same bytes.
2. LoRA (r=8 on q_proj/v_proj, peft when importable) on a small Llama, AdamW, batch 4 x 512 random
   tokens: the mean step time with ``client.save(..., blocking=False)`` every k steps against no
   saving (the loop without saves runs first and last; the faster is the base; each step ends
   with a device synchronize), the time the save call blocks the loop (median, mean, max) and
   each save's time from the call to its commit (a save slower than a step makes a later call
   wait), on the client's thread (``Client(background="thread")``); then again with
   ``Client(background="process")`` (the save's Python in a helper process, not the training
   loop's interpreter): what the default, ``"auto"``, does for a loop that saves often.

Times against safetensors' are printed as in bench/compare.py (seconds / safetensors' seconds:
below 1.00x is faster). A method that fails gets a note in its row and the run goes on.

    python3 bench/gpu.py                                  # CUDA, 2 GiB, about 3 minutes on an H100
    .venv/bin/python bench/gpu.py --quick --device cpu    # tiny sizes, any machine
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GIB,
    MIB,
    Row,
    check_real_disk,
    files_under,
    fsync_path,
    fsync_tree,
    same_tensors,
    tensor_bytes,
    timed,
    touch,
)
from dcp_compare import drop_cached  # noqa: E402
from report import add_ratios, machine_info, run_text  # noqa: E402

from ckptstore.client import Client  # noqa: E402

RUN = "bench"
#: Set in the environment of the run this script starts again with ``libcudart.so`` on the loader path.
CUDART_MARK = "CKPTSTORE_BENCH_CUDART"
COLD, WARM = "load cold", "load warm"
#: The seconds of a row not measured (a method that failed, a floor this machine lacks).
NAN = float("nan")
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


@dataclass(frozen=True)
class Sizes:
    """How big everything is: the state of table 1 and the Llama of table 2."""

    state_mib: int
    tensors: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    batch: int
    seq: int
    steps: int


FULL = Sizes(2048, 128, 3072, 8192, 16, 24, 32000, 4, 512, 64)
QUICK = Sizes(32, 16, 64, 128, 2, 4, 512, 2, 32, 16)


# --------------------------------------------------------------------------------------
# Table 1: a state in GPU memory
# --------------------------------------------------------------------------------------


class Flat(nn.Module):
    """``count`` bf16 matrices as frozen parameters ``t000``, ``t001``...: a model's state alone."""

    def __init__(self, count: int, total_bytes: int, device: torch.device, seed: int | None) -> None:
        super().__init__()
        cols = 2048 if total_bytes // count >= 2048 * 2 * 64 else 64
        rows = total_bytes // count // 2 // cols
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        for index in range(count):
            data = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
            if generator is not None:
                data.normal_(generator=generator)
            self.register_parameter(f"t{index:03d}", nn.Parameter(data, requires_grad=False))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Way:
    """A checkpoint format: a durable save of a module's state into an empty folder, a load of it
    onto the device. ``load`` returns the loaded tensors by name; ``target`` is a module of the
    same shapes on the device that a method loading in place fills."""

    name = ""

    def save(self, model: nn.Module, folder: Path) -> float:
        """Seconds of a durable save of ``model``'s state into ``folder``."""
        return timed(lambda: self._save(model.state_dict(), folder))[0]

    def _save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        raise NotImplementedError

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        """The state saved in ``folder``, on ``device``."""
        raise NotImplementedError


class Safetensors(Way):
    name = "safetensors"

    def _save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        safetensors.torch.save_file(state, folder / "model.safetensors")
        fsync_path(folder / "model.safetensors")
        fsync_path(folder)

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        return safetensors.torch.load_file(folder / "model.safetensors", device=str(device))


class FastSafetensors(Way):
    """fastsafetensors' own defaults: ``ParallelSaver`` (16 shard files, 8 threads), fsync on."""

    name = "fastsafetensors"

    def _save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        from fastsafetensors import ParallelSaver

        ParallelSaver(fsync=True).save(state, str(folder / "model"))

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        from fastsafetensors import fastsafe_open

        files = sorted(str(path) for path in folder.glob("*.safetensors"))
        with fastsafe_open(files, framework="pt", device=str(device), nogds=True) as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}


class TorchSave(Way):
    name = "torch.save"

    def _save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        with open(folder / "checkpoint.pt", "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_path(folder)

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        return torch.load(folder / "checkpoint.pt", mmap=True, map_location=device, weights_only=True)


class DistributedCheckpoint(Way):
    """DCP without a process group; it loads in place, into the target's tensors."""

    name = "DCP"

    def _save(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        dcp.save(state, checkpoint_id=folder, no_dist=True)
        fsync_tree(folder)  # DCP fsyncs its data files; the metadata file and folder too

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        state = target.state_dict()
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        return state


class Ckptstore(Way):
    """The embedded store: the first save into a fresh store, on a client opened off the clock; a
    load into the target module on the device, opening the client included (as a resumed job)."""

    name = "ckptstore"

    def save(self, model: nn.Module, folder: Path) -> float:
        with Client(home=folder) as ckpt:
            return timed(lambda: ckpt.save(RUN, model))[0]

    def load(self, folder: Path, target: nn.Module, device: torch.device) -> Mapping[str, torch.Tensor]:
        with Client(home=folder) as ckpt:
            ckpt.load(RUN, model=target, device=device)
        return target.state_dict()


def ways() -> tuple[list[Way], list[str]]:
    """The methods to run, and a note for each one left out."""
    found: list[Way] = [Safetensors()]
    notes = []
    try:
        from fastsafetensors import ParallelSaver, fastsafe_open  # noqa: F401

        found.append(FastSafetensors())
    except ImportError as exc:
        notes.append(f"fastsafetensors: row skipped, not importable with this API ({exc})")
    return [*found, TorchSave(), DistributedCheckpoint(), Ckptstore()], notes


def cold(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache: dirty pages written first, then fadvise each.
    (An earlier load's tensors are gone by then: ``del``, and the collection ``timed`` runs first.)"""
    os.sync()
    drop_cached(folder)


def fresh(path: Path) -> Path:
    """An empty folder at ``path``."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()
    return path


def zero(module: nn.Module) -> None:
    """Overwrite a load target, so a load that writes nothing cannot pass the check."""
    with torch.no_grad():
        for tensor in module.state_dict().values():
            tensor.zero_()


def one_way(way: Way, model: nn.Module, target: nn.Module, folder: Path, device: torch.device) -> dict[str, float]:
    """Seconds of a save, a cold load and a warm load by ``way``; raises if a load is wrong."""
    seconds = {"save": way.save(model, folder)}
    for operation in (COLD, WARM):
        zero(target)
        if operation == COLD:
            cold(folder)

        def load() -> Mapping[str, torch.Tensor]:
            loaded = way.load(folder, target, device)
            sync(device)
            if device.type == "cpu":  # a mapped file is read when touched: read it all, as every load must
                touch(loaded.values())
            return loaded

        seconds[operation], loaded = timed(load)
        if not same_tensors(dict(loaded), model):
            raise RuntimeError(f"{operation}: the loaded values differ from the saved ones")
        del loaded
    return seconds


def parallel_dd(store: Path, files: list[Path]) -> float:
    """Seconds for ``dd`` to read each of ``files`` (under ``store``) to /dev/null, all at once,
    from a cold cache."""
    cold(store)
    started = time.perf_counter()
    readers = [subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=16M", "status=none"]) for path in files]
    if any(reader.wait() != 0 for reader in readers):
        raise RuntimeError("dd failed")
    return time.perf_counter() - started


def pinned_copies(nbytes: int, device: torch.device, repeats: int = 3) -> tuple[list[float], list[float]]:
    """Seconds of host-to-device and device-to-host copies of ``nbytes`` between pinned memory and
    the device."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up: list[float] = []
    down: list[float] = []
    for _ in range(repeats):
        for into, source, times in ((on_device, host, up), (host, on_device, down)):
            sync(device)
            started = time.perf_counter()
            into.copy_(source, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - started)
    return up, down


def data_path(
    args: argparse.Namespace, sizes: Sizes, device: torch.device, root: Path, deadline: float
) -> tuple[list[Row], list[str]]:
    """Table 1 and the notes under it: every method, round after round (order rotated) until
    ``--repeats`` or the deadline; then the floors."""
    nbytes = sizes.state_mib * MIB
    model = Flat(sizes.tensors, nbytes, device, seed=0)
    target = Flat(sizes.tensors, nbytes, device, seed=None)
    nbytes = tensor_bytes(model.state_dict().values())
    methods, notes = ways()
    seconds: dict[tuple[str, str], list[float]] = {}
    failed: dict[str, str] = {}
    for number in range(args.repeats):
        started = time.perf_counter()
        shift = number % len(methods)
        for way in methods[shift:] + methods[:shift]:
            if way.name in failed:
                continue
            try:
                got = one_way(way, model, target, fresh(root / way.name), device)
            except Exception as exc:  # a peer's failure is a row's note, not the end of the run
                failed[way.name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                print(f"{way.name}: {failed[way.name]}", flush=True)
                continue
            for operation, value in got.items():
                seconds.setdefault((way.name, operation), []).append(value)
            cells = ", ".join(f"{operation} {value:.3f} s" for operation, value in got.items())
            print(f"round {number + 1}: {way.name}: {cells}", flush=True)
            if way.name != "ckptstore":
                shutil.rmtree(root / way.name, ignore_errors=True)
        if time.perf_counter() + (time.perf_counter() - started) > deadline:
            notes.append(f"{number + 1} of {args.repeats} rounds: the next would pass the time budget")
            break
    rows = [Row(name, operation, values, nbytes) for (name, operation), values in seconds.items()]
    rows += [Row(name, "-", [NAN], nbytes, note=why) for name, why in failed.items()]
    names = [way.name for way in methods]
    rows.sort(key=lambda row: (["save", COLD, WARM, "-"].index(row.operation), names.index(row.method)))
    add_ratios(rows)
    mode = root / "ckptstore" / "staging" / "write-mode.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        chosen = "direct" if json.loads(mode.read_text())["direct"] else "buffered"
        notes.append(f"ckptstore chose {chosen} writes (its probe of the disk, inside the first save)")
    rows += floors(root / "ckptstore", nbytes, device)
    del model, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, notes


def floors(store: Path, nbytes: int, device: torch.device) -> list[Row]:
    """What the disk and the bus allow: ``dd`` of the store's shard files, pinned copies."""
    rows = []
    shards = [path for path in files_under(store / "blobs") if path.stat().st_size >= MIB]
    try:
        if shards:
            size = sum(path.stat().st_size for path in shards)
            note = f"floor: {len(shards)} dd at once, bs=16M, of ckptstore's shard files"
            rows.append(Row("dd", "read cold", [parallel_dd(store, shards)], size, note=note))
    except (OSError, RuntimeError) as exc:
        rows.append(Row("dd", "read cold", [NAN], 0, note=f"failed: {exc}"))
    if device.type == "cuda":
        up, down = pinned_copies(nbytes, device)
        rows.append(Row("pinned copy", "host to device", up, nbytes, note="floor: one copy, median of 3"))
        rows.append(Row("pinned copy", "device to host", down, nbytes, note="median of 3"))
    else:
        rows.append(Row("pinned copy", "host to device", [NAN], nbytes, note="skipped: no CUDA device"))
    shutil.rmtree(store, ignore_errors=True)
    return rows


def format_rows(rows: list[Row]) -> str:
    """Table 1 as Markdown."""
    lines = [
        "| method | operation | seconds (median) | min-max s | GB/s | time vs safetensors | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row.seconds[0] != row.seconds[0]:  # NaN: not measured
            lines.append(f"| {row.method} | {row.operation} | - | - | - | - | {row.note} |")
            continue
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        spread = f"{min(row.seconds):.3f}-{max(row.seconds):.3f}"
        cells = [row.method, row.operation, f"{row.median:.3f}", spread, f"{row.gbps:.2f}", ratio, row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_peers(rows: list[Row]) -> str:
    """ckptstore's time over each peer's, per operation, and its speed against the floors."""
    by = {(row.method, row.operation): row for row in rows if row.seconds[0] == row.seconds[0]}
    peers = [name for name in ("safetensors", "fastsafetensors", "torch.save", "DCP") if (name, "save") in by]
    lines = ["| ckptstore time / peer time | " + " | ".join(peers) + " |", "|---|" + "---:|" * len(peers)]
    for operation in ("save", COLD, WARM):
        ours = by.get(("ckptstore", operation))
        if ours is None:
            continue
        cells = [f"{ours.median / by[(p, operation)].median:.2f}x" if (p, operation) in by else "-" for p in peers]
        lines.append(f"| {operation} | " + " | ".join(cells) + " |")
    load = by.get(("ckptstore", COLD))
    lines.append("")  # a line right under a Markdown table would be read as one of its rows
    for floor in (("dd", "read cold"), ("pinned copy", "host to device")):
        if load is not None and floor in by:
            lines.append(
                f"- ckptstore cold load: {load.gbps / by[floor].gbps:.2f} of the {' '.join(floor)} floor's GB/s"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Table 2: LoRA with a background save every k steps
# --------------------------------------------------------------------------------------


class LowRank(nn.Module):
    """A frozen linear layer plus a trainable rank-``rank`` update (the adapters, without peft)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        weight = base.weight
        self.down = nn.Parameter(torch.randn(rank, base.in_features, device=weight.device) * 0.01)
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, device=weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = (x.float() @ self.down.t()) @ self.up.t()
        return self.base(x) + update.to(x.dtype)


def lora_llama(sizes: Sizes, device: torch.device, own_adapters: bool) -> tuple[nn.Module, str]:
    """The Llama in bf16 with rank-8 adapters on q_proj and v_proj, and which adapters they are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.heads,
        max_position_embeddings=sizes.seq,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    if not own_adapters and importlib.util.find_spec("peft") is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return get_peft_model(model, lora), "peft LoRA"
    model.requires_grad_(False)
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.q_proj = LowRank(layer.self_attn.q_proj, 8)
        layer.self_attn.v_proj = LowRank(layer.self_attn.v_proj, 8)
    return model, "adapters of this script (peft not used)"


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    """One step on the fixed batch, finished on the device before it returns."""
    model(input_ids=tokens, labels=tokens).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    sync(tokens.device)


@dataclass
class Loop:
    """One timed run of the loop: mean step time, the time each save call blocked, and each
    save's time from the call to its commit."""

    every: int
    step_s: float
    blocked: list[float]
    #: Where the background saves ran.
    where: str = ""
    latency: list[float] = field(default_factory=list)


def run_loop(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, ckpt: Client,
             steps: int, every: int, where: str = "") -> Loop:  # fmt: skip
    """``steps`` steps, a background save after every ``every``-th (none for 0).

    Each row starts from a collected heap: the objects building the model left for the cyclic
    garbage collector are collected once, off the clock, not by whichever row comes first."""
    gc.collect()
    blocked: list[float] = []
    handles = []
    started = time.perf_counter()
    for step in range(steps):
        train_step(model, optim, tokens)
        if every and (step + 1) % every == 0:
            before = time.perf_counter()
            handles.append(ckpt.save("lora", model, optim, blocking=False))
            blocked.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    # Untimed: the last saves finish; raises if any failed. A result's seconds run from the call.
    latency = [handle.result().seconds for handle in handles]
    return Loop(every, elapsed / steps, blocked, where, latency)


def lora_table(args: argparse.Namespace, sizes: Sizes, device: torch.device, root: Path, deadline: float) -> str:
    """Table 2, as Markdown with a heading line."""
    model, adapters = lora_llama(sizes, device, args.own_adapters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), device=device, generator=generator)
    warm = []
    for _ in range(4):
        started = time.perf_counter()
        train_step(model, optim, tokens)
        warm.append(time.perf_counter() - started)
    step_s = statistics.median(warm[1:])
    with (
        Client(home=root / "lora", background="thread") as ckpt,
        Client(home=root / "lora-p", background="process") as helped,
    ):
        # Off the clock: the first save writes the frozen base; the first background one allocates
        # the staging buffers (and starts the save process). From then on a save stages the
        # trainable state alone.
        first = timed(lambda: ckpt.save("lora", model, optim))[0]
        ckpt.save("lora", model, optim, blocking=False).result()
        helped.save("lora", model, optim)
        helped.save("lora", model, optim, blocking=False).result()
        left = deadline - time.perf_counter()
        steps = max(16, min(sizes.steps, int(left / (8 * 1.3 * step_s)) // 16 * 16))
        loops = [
            run_loop(model, optim, tokens, ckpt, steps, every, "thread" if every else "") for every in (0, 1, 4, 16)
        ]
        loops += [run_loop(model, optim, tokens, helped, steps, every, "save process (auto)") for every in (1, 4, 16)]
        loops.append(run_loop(model, optim, tokens, ckpt, steps, 0))  # the loop alone again, last
    total = sum(p.numel() for p in model.parameters())
    state = tensor_bytes(trainable) + tensor_bytes(
        v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    heading = (
        f"LoRA r=8 on q_proj, v_proj ({adapters}); Llama {sizes.layers} layers, d={sizes.hidden}, "
        f"{total / 1e6:.0f}M parameters bf16, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable; AdamW; "
        f"batch {sizes.batch} x {sizes.seq} random tokens; {steps} steps per row; each save stages "
        f"{state / MIB:.1f} MiB (adapters + AdamW state); the first save (frozen base, off the clock) took "
        f"{first:.2f} s"
    )
    # The loop alone runs first and last; the faster of the two is the base (a drift of the
    # device's clocks over the rows would otherwise show as an overhead below zero).
    base = min(loop.step_s for loop in loops if not loop.every)
    lines = [
        heading + f"; overhead against the faster of the two rows without saves ({base * 1e3:.1f} ms)",
        "",
        "| saving | step ms (mean) | overhead | saves | save call blocks the loop, ms (median) | mean ms | max ms "
        "| call to commit, ms (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for loop in loops:
        which = "none" if not loop.every else f"every {loop.every} step{'s' if loop.every > 1 else ''}"
        which += f", {loop.where}" if loop.where else ""
        overhead = f"{(loop.step_s / base - 1) * 100:+.1f}%" if loop.every else "-"
        median, mean, top, latency = (
            (f"{f(values) * 1e3:.1f}" if values else "-")
            for f, values in (
                (statistics.median, loop.blocked),
                (statistics.mean, loop.blocked),
                (max, loop.blocked),
                (statistics.median, loop.latency),
            )
        )
        lines.append(
            f"| {which} | {loop.step_s * 1e3:.1f} | {overhead} | {len(loop.blocked)} | {median} | {mean} | {top} "
            f"| {latency} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def provide_cudart() -> None:
    """fastsafetensors loads the CUDA runtime as ``libcudart.so``, a name CUDA toolkits provide;
    torch's CUDA wheels ship ``libcudart.so.<major>`` only, so lend it that name if it lacks one."""
    major = (torch.version.cuda or "").split(".")[0]
    if major and importlib.util.find_spec("fastsafetensors") is not None:
        provide_library("libcudart.so", f"nvidia/*/lib/libcudart.so.{major}")


def provide_library(plain: str, pattern: str) -> None:
    """Where the library ``plain`` does not load but a file matching ``pattern`` under an entry of
    ``sys.path`` does, run this script again with a folder naming that file ``plain`` on
    ``LD_LIBRARY_PATH`` (which the loader reads at start only). Once: the new run is marked."""
    if os.environ.get(CUDART_MARK):
        return
    try:
        ctypes.CDLL(plain)
        return
    except OSError:
        pass
    found = [path for entry in sys.path if entry for path in sorted(Path(entry).glob(pattern))]
    if not found:
        return
    folder = Path(tempfile.mkdtemp(prefix="ckpt-gpu-lib-"))
    (folder / plain).symlink_to(found[0].resolve())
    paths = [str(folder), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    env = {**os.environ, CUDART_MARK: f"{plain} -> {found[0]}", "LD_LIBRARY_PATH": ":".join(paths)}
    print(f"{plain} -> {found[0]}: starting again with it on LD_LIBRARY_PATH", flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


@contextlib.contextmanager
def scratch(parent: Path | None, need: int) -> Iterator[Path]:
    """A temporary folder on a real disk (not tmpfs) with ``need`` bytes free, removed at the end."""
    candidates = [parent] if parent is not None else [Path(tempfile.gettempdir()), Path("/var/tmp"), Path.cwd()]
    for candidate in candidates:
        if not candidate.is_dir() or shutil.disk_usage(candidate).free < need:
            continue
        root = Path(tempfile.mkdtemp(prefix="ckpt-gpu-", dir=candidate))
        try:
            check_real_disk(root)
        except SystemExit:
            shutil.rmtree(root)
            continue
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    raise SystemExit(f"no folder on a real disk with {need / GIB:.1f} GiB free among {candidates}: pass --dir")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check that everything runs")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of table 1 at most (default 3)")
    parser.add_argument("--budget-s", type=float, default=200, help="seconds the whole run aims at (default 200)")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: temp, on a real disk)")
    parser.add_argument("--own-adapters", action="store_true", help="LoRA adapters of this script, not peft's")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run both tables and print them."""
    started = time.perf_counter()
    args = parse_args(argv)
    os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("torch sees no CUDA device: pass --device cpu (with --quick for tiny sizes)")
        provide_cudart()
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = QUICK if args.quick else FULL
    machine = machine_info()
    where = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    versions = {name: importlib.util.find_spec(name) is not None for name in ("fastsafetensors", "peft")}
    with scratch(args.dir, 3 * sizes.state_mib * MIB) as root:
        disk = run_text(["df", "-hT", str(root)]).splitlines()[-1:]
        print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}; device {where}; {machine['cpu']}, {machine['cores']} cores, "
              f"{machine['memory_gib']} GiB; torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"safetensors {machine['safetensors']}; importable: "
              f"{', '.join(name for name, ok in versions.items() if ok) or 'neither fastsafetensors nor peft'}; "
              f"commit {machine['commit']}; files in {root} ({' '.join(' '.join(disk).split()[:2])})",
              flush=True)  # fmt: skip
        rows, notes = data_path(args, sizes, device, root, started + 0.55 * args.budget_s)
        print(
            f"\n{sizes.state_mib / 1024:.2f} GiB bf16 in {sizes.tensors} tensors in {device.type} memory; saves "
            "durable; load cold = os.sync() + posix_fadvise(DONTNEED) on every file of the checkpoint first, "
            "load warm = again right after; GB/s = bytes / 1e9 / s\n"
        )
        print(format_rows(rows))
        print()
        print(format_peers(rows))
        for note in notes:
            print(f"- {note}")
        print(flush=True)
        print(lora_table(args, sizes, device, root, started + args.budget_s))
    print(f"\nwhole run {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
