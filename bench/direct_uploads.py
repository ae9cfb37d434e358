"""HTTP saves through a server on S3 blobs: shard bytes sent to S3 directly against through the server.

A fp32 transformer (``--size``, default 256 MiB) saved into a fresh store through ``ckptstore
serve`` (2 workers) whose blobs are in a ``moto_server`` process: with direct uploads (the client
PUTs the bytes to presigned S3 URLs; the server reads them back to verify them and copies them to
their blob keys inside S3) and with ``CKPTSTORE_UPLOAD_URL_SECONDS=0`` (every byte through the
server, which verifies it as it arrives and uploads it to S3). Alternating, ``--rounds`` rounds, a
fresh server and bucket each; prints every round, the medians, and the CPU seconds (user + system)
the server's processes spent on the save (psutil), and moto's. On a 2-core machine moto itself
takes a core, so the server's CPU seconds say more than the wall time: a direct upload costs moto
about twice the CPU of a proxied one (it takes the PUTs, joins the parts, serves the verifying
GET and copies the object in memory), where S3 does the copy and the join on its own machines.

    .venv/bin/python bench/direct_uploads.py
    .venv/bin/python bench/direct_uploads.py --size 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from ckptstore.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Shape, build_model, layers_for  # noqa: E402
from http_vs_embedded import cpu_seconds, s3_stand_in, served  # noqa: E402

MIB = 1 << 20
MODES = {"direct to S3": {}, "through the server": {"upload_url_seconds": "0"}}


def moto_process(url: str) -> psutil.Process | None:
    """The moto server listening at ``url``'s port, for its CPU seconds."""
    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return psutil.Process(connection.pid)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="MiB of the model")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    vocab, hidden = 32000, 1024
    shape = Shape(vocab, hidden, layers_for(args.size * MIB, vocab, hidden, torch.float32), "fp32", False)
    model = build_model(shape, "random")
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"cores: {os.cpu_count()}, torch {torch.__version__}, model {nbytes / MIB:.0f} MiB fp32")
    found: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ckptstore-bench-direct-") as scratch, s3_stand_in() as s3:
        moto = moto_process(s3)
        for number in range(args.rounds):
            for mode, settings in MODES.items():
                home = Path(scratch) / f"{mode.split()[0]}-{number}"
                with served(home, s3, **settings) as (url, server), Client(url) as ckpt:
                    ckpt.save("warm-up", torch.nn.Linear(4, 4))  # connections and first-request costs off the clock
                    before, moto_before = cpu_seconds(server), cpu_seconds(moto) if moto else 0.0
                    started = time.perf_counter()
                    ckpt.save("bench", model)
                    wall = time.perf_counter() - started
                    spent = cpu_seconds(server) - before
                    moto_spent = (cpu_seconds(moto) if moto else 0.0) - moto_before
                found[mode].append((wall, spent, moto_spent))
                print(f"round {number + 1} {mode:<20} save {wall:6.2f} s  server CPU {spent:6.2f} s  ", end="")
                print(f"moto CPU {moto_spent:6.2f} s")
    print(f"\n## HTTP save of {nbytes / MIB:.0f} MiB, server on S3 (moto) blobs, medians of {args.rounds}")
    print(f"{'shard bytes':<22}{'save s':>9}{'MB/s':>8}{'server CPU s':>14}{'moto CPU s':>12}")
    for mode, rows in found.items():
        wall, spent, moto_spent = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"{mode:<22}{wall:>9.2f}{nbytes / wall / 1e6:>8.0f}{spent:>14.2f}{moto_spent:>12.2f}")


if __name__ == "__main__":
    main()
