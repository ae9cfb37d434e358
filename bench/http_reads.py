"""Loading over HTTP a version whose tensors sit in many shards, against the same tensors in one.

A version whose tensors changed at different times references one shard per save; a load
then reads a little from each. Three ways, on one ``ckptstore serve`` (as compare.py runs it),
each loading every tensor into a model and verifying it:

- ``one shard``: the same tensors saved together, one ranged GET per 64 MiB;
- ``many shards, GET per shard``: a ranged GET per shard, two at a time (the reader without
  the server's batched endpoint);
- ``many shards, batched``: ``POST /v1/shards/ranges``, many shards' ranges per request.

    .venv/bin/python bench/http_reads.py                # 1000 tensors of 16 KiB, 5 repeats
    .venv/bin/python bench/http_reads.py --tensors 4000 --tensor-kib 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import served  # noqa: E402

from ckptstore.client import Client  # noqa: E402
from ckptstore.client.loading.reader import TensorReader  # noqa: E402
from ckptstore.client.store_protocol import Transport  # noqa: E402

os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"


class PerShard:
    """A transport without ``read_ranges``: the reader falls back to one ranged GET per shard."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def __getattr__(self, name: str) -> Any:
        if name == "read_ranges":
            raise AttributeError(name)
        return getattr(self._transport, name)


def model(count: int, numel: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel)) for _ in range(count))
    return module


def load_seconds(ckpt: Client, run_id: str, per_shard: bool) -> float:
    """Seconds to read and verify every tensor of the run's latest version."""
    manifest = ckpt.transport.manifest(run_id)
    started = time.perf_counter()
    transport: Any = PerShard(ckpt.transport) if per_shard else ckpt.transport
    reader = TensorReader(transport, manifest, read_threads=ckpt.read_threads)
    count = sum(1 for _ in reader.read_many([e.key for e in manifest.tensors]))
    assert count == len(manifest.tensors)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--tensor-kib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    together, spread = model(args.tensors, args.tensor_kib * 256), model(args.tensors, args.tensor_kib * 256)
    with tempfile.TemporaryDirectory(prefix="ckpt-http-reads-") as home, served(Path(home)) as url:
        with Client(url) as ckpt:
            ckpt.save("one", together)
            ckpt.shard_bytes = 1  # every tensor a shard of its own, as after saves that each changed one
            saved = ckpt.save("many", spread)  # other values: nothing of "one" to share
            assert saved.shards == args.tensors, saved
            loaded = Client(url, hash_cache=False)
            rows = {
                "one shard": lambda: load_seconds(loaded, "one", per_shard=False),
                "many shards, GET per shard": lambda: load_seconds(loaded, "many", per_shard=True),
                "many shards, batched": lambda: load_seconds(loaded, "many", per_shard=False),
            }
            times: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(args.repeats):
                for name, run in rows.items():
                    times[name].append(run())
            loaded.close()
    size = args.tensors * args.tensor_kib / 1024
    print(f"load over HTTP: {args.tensors} tensors of {args.tensor_kib} KiB ({size:.1f} MiB), median of {args.repeats}")
    print(f"{'layout':<30}{'seconds':>9}{'vs one shard':>14}{'vs GET per shard':>18}")
    base, per_shard = statistics.median(times["one shard"]), statistics.median(times["many shards, GET per shard"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<30}{median:>9.3f}{median / base:>13.2f}x{median / per_shard:>17.2f}x")


if __name__ == "__main__":
    main()
