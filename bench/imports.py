"""What reading a foreign checkpoint costs: ``read_checkpoint`` of the formats users import, no store involved.

A transformer-shaped fp32 model (``--size`` MiB, default 256) with Adam state written once as a
``torch.save`` training checkpoint (``.pt``), a DCP folder (``dcp.save`` of ``get_state_dict``'s
layout, one process) and a ``model.safetensors`` file; then each is read ``--rounds`` times by
the import's readers (every check: allow-list pickle reader, zip member regions, DCP cover and
region checks, the budget, confined opens), warm page cache. Prints each round and the medians,
with the peak RSS growth. Run it on two checkouts to compare (``PYTHONPATH=<checkout>``).

    .venv/bin/python bench/imports.py
    .venv/bin/python bench/imports.py --size 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, Shape, build_model, layers_for  # noqa: E402

from ckptstore.client.formats.importing import read_checkpoint  # noqa: E402

warnings.filterwarnings("ignore")


def write_sources(folder: Path, size_mib: int) -> dict[str, Path]:
    """The model and its Adam state as a .pt checkpoint, a DCP folder and a safetensors file."""
    vocab, hidden = 8192, 512
    shape = Shape(vocab, hidden, layers_for(size_mib * MIB, vocab, hidden, torch.float32), "fp32", True)
    model = build_model(shape, "random")
    optim = torch.optim.Adam(model.parameters())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optim.step()
    torch.save(
        {"model_state_dict": model.state_dict(), "optimizer_state_dict": optim.state_dict(), "step": 1},
        folder / "training.pt",
    )
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / "dcp"), no_dist=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return {".pt training checkpoint": folder / "training.pt", "DCP folder": folder / "dcp",
            "model.safetensors": folder / "model.safetensors"}  # fmt: skip


def source_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256, help="MiB of the model's weights")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, model {args.size} MiB fp32 with Adam state")
    with tempfile.TemporaryDirectory() as scratch:
        sources = write_sources(Path(scratch), args.size)
        rows = []
        for name, path in sources.items():
            times = []
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for round_ in range(args.rounds):
                started = time.perf_counter()
                imported = read_checkpoint(path)
                times.append(time.perf_counter() - started)
                tensors = len(imported.model)
                del imported
                print(f"round {round_ + 1} {name:24} {times[-1]:6.3f} s  ({tensors} model tensors)")
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            rows.append((name, source_mib(path), statistics.median(times), grown))
    print(f"\n## read_checkpoint, {args.size} MiB model + Adam, warm cache, medians of {args.rounds}")
    print(f"{'source':24} {'MiB':>8} {'read s':>8} {'MB/s':>8} {'peak RSS growth MiB':>20}")
    for name, mib, seconds, grown in rows:
        print(f"{name:24} {mib:8.0f} {seconds:8.3f} {mib * MIB / 1e6 / seconds:8.0f} {grown:20.0f}")


if __name__ == "__main__":
    main()
