"""Durable saves with the store's direct (O_DIRECT) writes on and off, alternating in one run.

    .venv/bin/python bench/direct_writes.py [--size-gib 1] [--repeats 5] [--workdir DIR]

Times, round after round in a rotating order: ``safetensors.save_file`` + fsync, an embedded
ckptstore save with ``CKPTSTORE_DIRECT_WRITES`` on and off, and a save over HTTP to a
``ckptstore serve`` process (2 workers, started fresh for each save with the same setting;
start-up not timed). Every save goes to a fresh store, so every byte is written. Besides the
wall time it reports the CPU seconds of this process and of the server per save: buffered
writes spend theirs copying into newly allocated page-cache pages. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Shape,
    build_model,
    fresh_folder,
    fsync_path,
    layers_for,
    scratch_dir,
    served,
)
from torch import nn  # noqa: E402

from ckptstore.client import Client  # noqa: E402

os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"
RUN_ID = "bench"


def own_cpu() -> float:
    """CPU seconds this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def server_cpu() -> float:
    """CPU seconds of this process's descendants (a server and its workers)."""
    total = 0.0
    for pid in descendants(os.getpid()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measured(save: Callable[[], object]) -> tuple[float, float, float]:
    """(seconds, own CPU seconds, server CPU seconds) of one save."""
    cpu, served_cpu, started = own_cpu(), server_cpu(), time.perf_counter()
    save()
    return time.perf_counter() - started, own_cpu() - cpu, server_cpu() - served_cpu


def save_safetensors(model: nn.Module, folder: Path) -> tuple[float, float, float]:
    """safetensors.save_file + fsync of the file and its folder."""

    def work() -> None:
        safetensors.torch.save_file(model.state_dict(), folder / "model.safetensors")
        fsync_path(folder / "model.safetensors")
        fsync_path(folder)

    return measured(work)


def save_embedded(model: nn.Module, folder: Path, direct: bool) -> tuple[float, float, float]:
    """An embedded save to a fresh store (the client is opened first, outside the timing)."""
    os.environ["CKPTSTORE_DIRECT_WRITES"] = "1" if direct else "0"
    with Client(home=folder) as client:
        return measured(lambda: client.save(RUN_ID, model))


def save_http(model: nn.Module, folder: Path, direct: bool) -> tuple[float, float, float]:
    """A save over loopback HTTP to a fresh server on a fresh store."""
    os.environ["CKPTSTORE_DIRECT_WRITES"] = "1" if direct else "0"
    with served(folder) as url, Client(url) as client:
        return measured(lambda: client.save(RUN_ID, model))


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder parent on a real disk")
    args = parser.parse_args(argv)
    import torch

    vocab, hidden = 32000, 1024
    layers = layers_for(args.size_gib * (1 << 30), vocab, hidden, torch.float32)
    model = build_model(Shape(vocab, hidden, layers, "fp32", False), "random")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    workdir = scratch_dir(args.workdir)
    methods: dict[str, Callable[[Path], tuple[float, float, float]]] = {
        "safetensors save_file + fsync": lambda f: save_safetensors(model, f),
        "ckptstore embedded, direct writes": lambda f: save_embedded(model, f, True),
        "ckptstore embedded, buffered writes": lambda f: save_embedded(model, f, False),
        "ckptstore over HTTP, direct writes": lambda f: save_http(model, f, True),
        "ckptstore over HTTP, buffered writes": lambda f: save_http(model, f, False),
    }
    names = list(methods)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    try:
        for round_number in range(args.repeats + 1):
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:
                folder = fresh_folder(workdir / "save")
                os.sync()
                outcome = methods[name](folder)
                if round_number:
                    results[name].append(outcome)
            print(f"round {round_number} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    reference = statistics.median(r[0] for r in results[names[0]])
    print(f"{nbytes / (1 << 30):.3f} GiB fp32, median of {args.repeats} rounds after a warm-up, order rotated\n")
    print("| save | seconds (median) | min-max s | GB/s | speed vs safetensors | CPU s, this process | CPU s, server |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        seconds = [r[0] for r in results[name]]
        median = statistics.median(seconds)
        own = statistics.median(r[1] for r in results[name])
        server = statistics.median(r[2] for r in results[name])
        server_text = f"{server:.2f}" if "HTTP" in name else "-"
        print(
            f"| {name} | {median:.3f} | {min(seconds):.2f}-{max(seconds):.2f} | {nbytes / 1e9 / median:.2f} "
            f"| {reference / median:.2f}x | {own:.2f} | {server_text} |"
        )


if __name__ == "__main__":
    main()
