"""Multi-rank save and load: ckptstore's StoreWriter/StoreReader against DCP's FileSystemWriter/Reader.

Two ranks (gloo, CPU) each hold half of every tensor of a sharded state (DTensors, Shard(0)),
as FSDP leaves it. In the same run, alternating, each round: ``dcp.save`` to a new folder
with ``FileSystemWriter`` (files fsynced) and to a new ckptstore version with ``StoreWriter``
(fresh bytes each round, so nothing dedups; shards fsynced); then ``dcp.load`` of each into
allocated shards, after the files are dropped from the page cache (fadvise). Times are the
slowest rank's, between barriers; the table prints medians and ckptstore's speed relative
to DCP's (higher is better). Targets: save >= 0.9x, load >= 1.0x.

    .venv/bin/python bench/dcp_compare.py [--size-mib 1024] [--rounds 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD = 2
TENSORS = 16
TARGETS = {"save": 0.9, "load": 1.0}


def drop_cached(root: Path) -> None:
    """Make the next read of every file under ``root`` come from the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sharded_state(mesh: Any, size_bytes: int, fill: float | None) -> dict[str, Any]:
    """``TENSORS`` fp32 tensors of ``size_bytes`` in all, sharded by rows over the mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = size_bytes // TENSORS // 4 // 1024
    state = {}
    for index in range(TENSORS):
        local = torch.empty(rows // WORLD, 1024)
        if fill is None:
            local.normal_()
        else:
            local.fill_(fill)
        whole = torch.empty(rows, 1024, device="meta")
        state[f"layer{index}.weight"] = distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None)
        state[f"layer{index}.weight"]._local_tensor = local
    return {"model": state}


def timed(call: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    call()
    dist.barrier()
    return time.perf_counter() - started


def rank_main(rank: int, rendezvous: str, root: str, size_bytes: int, rounds: int, results: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore import client
    from ckptstore.client.distributed import StoreReader, StoreWriter

    os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))  # fmt: skip
    mesh = init_device_mesh("cpu", (WORLD,))
    base = Path(root)
    store = client.Client(home=base / "store")
    times: dict[str, list[float]] = {"DCP FileSystemWriter": [], "ckptstore StoreWriter": []}
    times |= {"DCP FileSystemReader": [], "ckptstore StoreReader": []}
    target = sharded_state(mesh, size_bytes, 0.0)
    for number in range(rounds):
        state = sharded_state(mesh, size_bytes, None)
        folder = base / f"dcp-{number}"
        writers = {
            "DCP FileSystemWriter": dcp.FileSystemWriter(folder),
            "ckptstore StoreWriter": StoreWriter("bench", client=store),
        }
        for name, writer in writers.items():
            times[name].append(timed(partial(dcp.save, state, storage_writer=writer)))
        readers = {
            "DCP FileSystemReader": (dcp.FileSystemReader(folder), folder),
            "ckptstore StoreReader": (StoreReader("bench", client=store), base / "store"),
        }
        for name, (reader, files) in readers.items():
            if rank == 0:
                drop_cached(files)
            times[name].append(timed(partial(dcp.load, target, storage_reader=reader)))
            for key, tensor in state["model"].items():
                assert torch.equal(target["model"][key].to_local(), tensor.to_local()), (name, key)
    results.put((rank, times))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="state size over both ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp", help="where files go (a real disk, not tmpfs)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dcp-compare-") as root:
        context = mp.get_context("spawn")
        results = context.Queue()
        processes = [
            context.Process(
                target=rank_main,
                args=(rank, f"{root}/rendezvous", root, args.size_mib << 20, args.rounds, results),
            )
            for rank in range(WORLD)
        ]
        for process in processes:
            process.start()
        by_rank = dict(results.get() for _ in processes)
        for process in processes:
            process.join()
    gib = args.size_mib / 1024
    print(f"{WORLD} ranks, {gib:.2f} GiB fp32 state sharded by rows, {args.rounds} rounds (median)")
    print("| what | seconds | GiB/s | ckptstore vs DCP speed |\n|---|---:|---:|---:|")
    failed = []
    for phase, ours, theirs in (
        ("save", "ckptstore StoreWriter", "DCP FileSystemWriter"),
        ("load", "ckptstore StoreReader", "DCP FileSystemReader"),
    ):
        medians = {name: statistics.median(by_rank[0][name]) for name in (theirs, ours)}
        ratio = medians[theirs] / medians[ours]
        print(f"| {theirs} | {medians[theirs]:.3f} | {gib / medians[theirs]:.2f} | 1.00x |")
        print(f"| {ours} | {medians[ours]:.3f} | {gib / medians[ours]:.2f} | {ratio:.2f}x |")
        if ratio < TARGETS[phase]:
            failed.append(f"{phase}: {ratio:.2f}x < {TARGETS[phase]}x")
    print("targets met" if not failed else "targets missed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
