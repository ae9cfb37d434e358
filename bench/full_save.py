"""The first full save into a fresh embedded store against ``safetensors.save_file`` + fsync, per run.

Each run saves the same transformer-shaped model (compare.py's, 768 MiB fp32 by default) both
ways, durably (files and folders fsynced), alternating which goes first; the ckptstore save is
``client.save`` on a client opened on a new store before the clock starts. Every run prints its
own ratio (safetensors' seconds / ckptstore's: 1.00x or more means ckptstore is at least as
fast), since on a shared machine a median can hide a losing run. ``--write-modes`` also runs
the save with direct writes forced on and off (``CKPTSTORE_DIRECT_WRITES``), next to the
store's own choice.

    .venv/bin/python bench/full_save.py                       # 5 runs, 768 MiB
    .venv/bin/python bench/full_save.py --runs 3 --size-mib 256 --write-modes
    .venv/bin/python bench/full_save.py --sizes-held    # hashed first: a store holding the architecture
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Shape, build_model, fsync_path, layers_for  # noqa: E402

from ckptstore.client import Client  # noqa: E402

os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"
MIB = 1 << 20


def safetensors_save(model: torch.nn.Module, folder: Path) -> float:
    gc.collect()
    started = time.perf_counter()
    path = folder / "model.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(path))
    fsync_path(path)
    fsync_path(folder)
    return time.perf_counter() - started


def ckptstore_save(model: torch.nn.Module, folder: Path, direct: str | None, sibling: torch.nn.Module | None) -> float:
    """Seconds of the first save of ``model`` into a new store at ``folder``; with ``sibling``, the
    store first holds that model (same shapes, other values) under another run, off the clock."""
    if direct is None:
        os.environ.pop("CKPTSTORE_DIRECT_WRITES", None)
    else:
        os.environ["CKPTSTORE_DIRECT_WRITES"] = direct
    with Client(home=folder) as ckpt:
        if sibling is not None:
            ckpt.save("sibling", sibling)
            os.sync()
        gc.collect()
        started = time.perf_counter()
        ckpt.save("bench", model)
        seconds = time.perf_counter() - started
    if direct is None:
        CHOSEN.append(_chosen_mode(folder / "staging" / "write-mode.json"))
    return seconds


#: The write mode the store chose by measuring its disk, for each save that left it to the store.
CHOSEN: list[str] = []


def _chosen_mode(path: Path) -> str:
    try:
        return "direct" if json.loads(path.read_text())["direct"] else "buffered"
    except (OSError, ValueError, KeyError):
        return "unknown"


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=768)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="a folder on the disk to measure (default: temp)")
    parser.add_argument("--write-modes", action="store_true", help="also force direct writes on and off")
    parser.add_argument(
        "--sizes-held",
        action="store_true",
        help="the store already holds a model of the same shapes (other values): the save hashes, asks, then sends",
    )
    args = parser.parse_args()
    vocab, hidden = 32000, 1024
    layers = layers_for(args.size_mib * MIB, vocab, hidden, torch.float32)
    model = build_model(Shape(vocab, hidden, layers, "fp32", False), "random")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    sibling = None
    if args.sizes_held:
        sibling = build_model(Shape(vocab, hidden, layers, "fp32", False), "random")
        with torch.no_grad():
            for param in sibling.parameters():
                param.add_(1.0)
    ways: dict[str, Callable[[Path], float]] = {"ckptstore": lambda p: ckptstore_save(model, p, None, sibling)}
    if args.write_modes:
        ways["ckptstore direct"] = lambda p: ckptstore_save(model, p, "1", sibling)
        ways["ckptstore buffered"] = lambda p: ckptstore_save(model, p, "0", sibling)
    root = Path(tempfile.mkdtemp(prefix="ckpt-full-save-", dir=args.workdir))
    try:
        safetensors_save(model, fresh(root / "warmup"))  # the first pass over fresh memory is slow on VMs
        ckptstore_save(model, fresh(root / "warmup"), None, sibling)
        held = "; the store holds a model of the same shapes" if sibling is not None else ""
        print(f"first full save, {nbytes / MIB:.0f} MiB fp32, durable{held}; ratio = safetensors s / ckptstore s")
        print(f"{'run':>3}  {'safetensors s':>13}" + "".join(f"  {name + ' s':>20}  {'ratio':>6}" for name in ways))
        times: dict[str, list[float]] = {"safetensors": [], **{name: [] for name in ways}}
        for run in range(args.runs):
            order = ["safetensors", *ways] if run % 2 == 0 else [*ways, "safetensors"]
            row: dict[str, float] = {}
            for name in order:
                folder = fresh(root / name.replace(" ", "-"))
                row[name] = safetensors_save(model, folder) if name == "safetensors" else ways[name](folder)
                times[name].append(row[name])
            cells = "".join(f"  {row[n]:>20.3f}  {row['safetensors'] / row[n]:>5.2f}x" for n in ways)
            print(f"{run + 1:>3}  {row['safetensors']:>13.3f}{cells}")
        base = statistics.median(times["safetensors"])
        cells = "".join(
            f"  {statistics.median(times[n]):>20.3f}  {base / statistics.median(times[n]):>5.2f}x" for n in ways
        )
        print(f"{'med':>3}  {base:>13.3f}{cells}")
        for name in ways:
            wins = sum(s >= c for s, c in zip(times["safetensors"], times[name], strict=True))
            print(f"{name}: at least as fast as safetensors in {wins} of {args.runs} runs")
        chosen = Counter(CHOSEN[1:])  # the warm-up's choice left out
        print("write mode the store chose: " + ", ".join(f"{mode} {count}x" for mode, count in chosen.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
