"""ckptstore over HTTP against its embedded store, and many readers of one server on S3 blobs.

Prints, in one run:

1. **Save and load.** A fp32 transformer (``--size``, default 512 MiB): the first save into a
   fresh store, embedded and through ``ckptstore serve`` on a local folder and on S3 (a
   ``moto_server`` process stands in for S3 here; MinIO in docker-compose), alternating, medians
   of ``--rounds``; and a load into an existing model, the embedded one reading the same files
   as the local-folder server's (see :func:`save_and_load`), and a resumed job's load: a new
   process's first, its client's start included. Each ratio is the embedded time over the HTTP
   time (1.0x: as fast as embedded).
2. **A loop's next save.** One client saves, waits past the server's keep-alive timeout (a
   training loop's steps between checkpoints), then saves again with every tensor changed:
   embedded and over HTTP on a local folder, medians of ``--rounds``.
3. **Many readers.** ``--readers`` processes (default 8) loading the same version (``--read-size``,
   default 1 GiB) at once through one server: on S3 blobs with signed read URLs (the bytes come
   from S3 directly) and with ``CKPTSTORE_READ_URL_SECONDS=0`` (every byte through the server),
   and on a local folder with downloads sent by the kernel (``sendfile``) and streamed
   (``CKPTSTORE_SENDFILE=false``): the aggregate load throughput and the CPU seconds the
   server's processes spent.

The server and moto run as processes of their own; server start-up is not timed, and each
timed call starts after ``os.sync()``. Page cache: a local folder's shards are written around
it (``O_DIRECT``), and each load starts with it dropped where the bench may (as root), so the
loads read the disk; moto keeps its objects in memory and temporary files. The server's CPU
seconds (its workers' user and system time) are printed beside each HTTP row. On a 2-core
machine the S3 stand-in itself takes a core, so compare the server's CPU seconds more than the
throughput.
Each store measures its own write mode unless ``CKPTSTORE_DIRECT_WRITES`` says which
(:mod:`service.intake.write_mode`); the ``writes`` column tells how many rounds' stores wrote direct,
since a store that drew buffered writes saves slower and leaves its shards in the page cache.
The project's modules are byte-compiled first, as an installed package has them: a server's
first request imports modules the server had not needed yet, and with ``PYTHONDONTWRITEBYTECODE``
set (as on the bench's VM) it would compile them from source on the clock.

    .venv/bin/python bench/http_vs_embedded.py --quick      # 128 MiB, 256 MiB read by 4 readers, 1 round
    .venv/bin/python bench/http_vs_embedded.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import boto3
import psutil
import torch

from ckptstore.client import Client
from ckptstore.service.intake.write_mode import CACHE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_start import compile_bytecode  # noqa: E402
from common import Shape, build_model, layers_for  # noqa: E402

MIB = 1 << 20
RUN = "bench"
READER = """
import sys, time
from ckptstore.client import Client
from ckptstore.service.intake.write_mode import CACHE_NAME
started = time.perf_counter()
with Client(sys.argv[1]) as ckpt:
    state = ckpt.load(sys.argv[2]).state_dict
print(time.perf_counter() - started, sum(t.numel() * t.element_size() for t in state.values()))
"""


FIRST_LOAD = """
import sys, time
sys.path.insert(0, sys.argv[3])
from ckptstore.client import Client
from http_vs_embedded import fp32_model
target = fp32_model(int(sys.argv[2]), "zeros")
where = sys.argv[1]
started = time.perf_counter()
with Client(where) if where.startswith("http") else Client(home=where) as ckpt:
    ckpt.load(sys.argv[4], model=target)
print(time.perf_counter() - started)
"""


def fp32_model(size: int, init: str) -> torch.nn.Module:
    """The bench's fp32 transformer of about ``size`` bytes, its weights ``init`` ("random", "zeros")."""
    vocab, hidden = 32000, 1024
    return build_model(Shape(vocab, hidden, layers_for(size, vocab, hidden, torch.float32), "fp32", False), init)


def first_load(where: str, size: int) -> float:
    """Seconds a new process takes to open a client of ``where`` (a server's URL or a store's
    folder) and load the bench's run into a model of ``size`` bytes, from a dropped page cache."""
    os.sync()
    drop_page_cache()
    bench = str(Path(__file__).resolve().parent)
    command = [sys.executable, "-c", FIRST_LOAD, where, str(size), bench, RUN]
    answer = subprocess.run(command, capture_output=True, text=True)
    if answer.returncode != 0:
        raise RuntimeError(f"the first load from {where} failed: {answer.stderr[-2000:]}")
    return float(answer.stdout.split()[-1])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:  # a harness polls; the timed work starts once it answers
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError as exc:
            if getattr(exc, "code", None) is not None:  # an HTTP answer: it is up
                return
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.05)


@contextmanager
def s3_stand_in() -> Iterator[str]:
    """A ``moto_server`` process on loopback; yields its URL (credentials set in this environment)."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextmanager
def served(home: Path, s3: str | None, **settings: str) -> Iterator[tuple[str, psutil.Process]]:
    """``ckptstore serve`` (2 workers) on ``home``, its blobs in a fresh bucket of ``s3`` when given."""
    port = _free_port()
    env = {**os.environ, "CKPTSTORE_HOME": str(home), "CKPTSTORE_PORT": str(port), "CKPTSTORE_WORKERS": "2"}
    env.pop("CKPTSTORE_URL", None)
    env.update({f"CKPTSTORE_{k.upper()}": v for k, v in settings.items()})
    if s3 is not None:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=bucket)
        env.update(CKPTSTORE_BLOBS=f"s3://{bucket}/ckpt", AWS_ENDPOINT_URL=s3)
    server = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.client.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{url}/healthz", server)
        yield url, psutil.Process(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)


def cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds (user + system) of ``process`` and its children (the server's workers)."""
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def direct_writes(home: Path) -> bool | None:
    """Whether the store in ``home`` writes shards direct: its cached probe's choice, else the
    setting; None where neither says (S3 blobs)."""
    for cache in home.rglob(CACHE_NAME):
        return bool(json.loads(cache.read_text())["direct"])
    setting = os.environ.get("CKPTSTORE_DIRECT_WRITES")
    return None if setting is None else setting not in ("0", "false")


def modes(found: list[bool | None]) -> str:
    """``direct k/n`` for the rounds' write modes, or ``-`` where none was known."""
    known = [mode for mode in found if mode is not None]
    return f"direct {sum(known)}/{len(known)}" if known else "-"


def timed(action: object, *, cold: bool = False) -> float:
    """Seconds ``action()`` takes, started on a quiet disk: what earlier rows left to write back
    (moto keeps its objects in temporary files) is flushed first, off the clock; with ``cold``,
    the page cache is then dropped too where this process may (:func:`drop_page_cache`)."""
    os.sync()
    if cold:
        drop_page_cache()
    started = time.perf_counter()
    action()  # type: ignore[operator]
    return time.perf_counter() - started


def drop_page_cache() -> bool:
    """Empty the page cache (Linux, as root), so that a load reads the disk; whether it could."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("1")
    except OSError:
        return False
    return True


def save_and_load(root: Path, s3: str, size: int, rounds: int) -> None:
    """Section 1: the local saves, embedded and over HTTP alternating; then the local loads; then
    HTTP on S3, save and load.

    Every save goes into a fresh store; the embedded and the local-folder saves take turns at
    going first, so that neither always follows the other's writes. The loads read the first
    HTTP store's files, embedded and through one server in turn (which goes first alternates by
    round), each from the disk, after one load off the clock (the first load through a fresh
    server and client took 0.5 s where the next ones took 0.32-0.42 s). Each kind of work comes
    in a block of its own, since on this VM what one kind left behind changed the next one's time:

    - a load right after the save that wrote its bytes found the disk still busy with them (a
      512 MiB embedded load took 0.4-1.3 s then, against 0.3-0.4 s for the same files at rest);
    - an HTTP save after loads that emptied the page cache took 0.36-0.45 s, against 0.30-0.40 s
      after saves alone (embedded saves: the same either way);
    - with the S3 stand-in holding the objects of earlier rounds on this machine, the local-folder
      HTTP saves of the later rounds took 0.40-0.47 s.
    """
    model, target = fp32_model(size, "random"), fp32_model(size, "zeros")
    found: dict[str, dict[str, list[float]]] = {}

    def times_of(name: str) -> dict[str, list[float]]:
        return found.setdefault(name, {"save": [], "load": [], "save cpu": [], "load cpu": [], "direct": []})

    def home_of(name: str, number: int) -> Path:
        return root / f"{name.replace(' ', '_').replace(',', '')}-{number}"

    def measure(name: str, what: str, ckpt: Client, server: psutil.Process | None) -> None:
        """Time ``what`` ("save" or "load", the latter from a dropped page cache) of store ``name``,
        and the CPU seconds ``server`` spent on it."""
        before = cpu_seconds(server) if server is not None else 0.0
        if what == "save":
            times_of(name)[what].append(timed(lambda: ckpt.save(RUN, model)))
        else:
            times_of(name)[what].append(timed(lambda: ckpt.load(RUN, model=target), cold=True))
        if server is not None:
            times_of(name)[f"{what} cpu"].append(cpu_seconds(server) - before)

    local = ["embedded", "http, local folder"]
    for number in range(rounds):
        for name in local if number % 2 == 0 else local[::-1]:
            home = home_of(name, number)
            if name == "embedded":
                with Client(home=home) as ckpt:
                    measure(name, "save", ckpt, None)
            else:
                with served(home, None) as (url, server), Client(url) as ckpt:
                    measure(name, "save", ckpt, server)
            times_of(name)["direct"].append(direct_writes(home))
    home = home_of("http, local folder", 0)
    with served(home, None) as (url, server):
        with Client(url) as ckpt:
            ckpt.load(RUN, model=target)  # off the clock: a server in use has answered a load before
        for number in range(rounds):
            for name in local if number % 2 == 0 else local[::-1]:
                with Client(url) if name != "embedded" else Client(home=home) as ckpt:
                    measure(name, "load", ckpt, server if name != "embedded" else None)
        for number in range(rounds):
            for name in local if number % 2 == 0 else local[::-1]:
                where = str(home) if name == "embedded" else url
                times_of(name).setdefault("first load", []).append(first_load(where, size))
    for number in range(rounds):
        name = "http, S3"
        home = home_of(name, number)
        with served(home, s3) as (url, server):
            with Client(url) as ckpt:
                measure(name, "save", ckpt, server)
            with Client(url) as ckpt:
                measure(name, "load", ckpt, server)
        times_of(name)["direct"].append(direct_writes(home))
    base = {what: statistics.median(found["embedded"][what]) for what in ("save", "load")}
    print(f"\n## Save and load, {size / MIB:.0f} MiB fp32, medians of {rounds}")
    cache = "dropped before each load" if drop_page_cache() else "not dropped (that needs root)"
    print("(the first save into a fresh store; a load into an existing model, embedded and over HTTP")
    print(f" reading the same local files in turn, from the disk: page cache {cache})")
    print(" writes: the rounds whose store wrote its shards direct (O_DIRECT), as its probe chose or")
    print(" CKPTSTORE_DIRECT_WRITES said; the others wrote buffered")
    columns = f"{'vs embedded':>13}{'server CPU s':>14}"
    print(f"{'store':<22}{'save s':>9}{columns}{'load s':>9}{columns}{'writes':>13}")
    for name, times in found.items():
        save, load = statistics.median(times["save"]), statistics.median(times["load"])
        cpu = {
            what: f"{statistics.median(times[f'{what} cpu']):.2f}" if times[f"{what} cpu"] else ""
            for what in ("save", "load")
        }
        print(
            f"{name:<22}{save:>9.2f}{base['save'] / save:>12.2f}x{cpu['save']:>14}"
            f"{load:>9.2f}{base['load'] / load:>12.2f}x{cpu['load']:>14}"
            f"{modes(times['direct']):>13}"
        )
    first = {name: statistics.median(times["first load"]) for name, times in found.items() if "first load" in times}
    print("\nA resumed job's load: a new process's first load of the same files, the client's start")
    print(f"included, medians of {rounds}")
    for name, seconds in first.items():
        print(f"{name:<22}{seconds:>9.2f}{first['embedded'] / seconds:>12.2f}x")


#: The loop rows' server closes connections idle this long (seconds; 5 by default), and the loop
#: waits longer than that between its two saves.
LOOP_KEEP_ALIVE_SECONDS = 1.0
LOOP_PAUSE_SECONDS = 1.5


def loop_saves(root: Path, size: int, rounds: int) -> None:
    """Section 2: a training loop's next save. One client saves, sits idle past the server's
    keep-alive timeout (the loop trains between checkpoints), then saves again with every tensor
    changed; embedded and over HTTP on a local folder, taking turns at going first."""
    model = fp32_model(size, "random")
    found: dict[str, list[float]] = {"embedded": [], "http, local folder": []}
    names = list(found)
    for number in range(rounds):
        for name in names if number % 2 == 0 else names[::-1]:
            home = root / f"loop-{name.replace(' ', '_').replace(',', '')}-{number}"
            with ExitStack() as stack:
                if name == "embedded":
                    ckpt = stack.enter_context(Client(home=home))
                else:
                    url, _ = stack.enter_context(served(home, None, keep_alive_timeout=str(LOOP_KEEP_ALIVE_SECONDS)))
                    ckpt = stack.enter_context(Client(url))
                ckpt.save(RUN, model)
                time.sleep(LOOP_PAUSE_SECONDS)  # the loop's steps: the server closes the idle connections
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                found[name].append(timed(lambda ckpt=ckpt: ckpt.save(RUN, model)))
    base = statistics.median(found["embedded"])
    print(f"\n## A loop's next save, {size / MIB:.0f} MiB fp32, every tensor changed, medians of {rounds}")
    print(f"(the same client's second save, {LOOP_PAUSE_SECONDS:.1f} s after its first; the server closes")
    print(f" connections idle for {LOOP_KEEP_ALIVE_SECONDS:.0f} s)")
    print(f"{'store':<22}{'save s':>9}{'vs embedded':>13}")
    for name, times in found.items():
        print(f"{name:<22}{statistics.median(times):>9.2f}{base / statistics.median(times):>12.2f}x")


def many_readers(root: Path, s3: str, size: int, readers: int) -> None:
    """Section 3: ``readers`` processes loading one version at once, direct and proxied."""
    model = fp32_model(size, "random")
    print(f"\n## {readers} readers of one {size / MIB:.0f} MiB version at once, through one server")
    print(f"{'reads':<44}{'aggregate MB/s':>16}{'slowest s':>11}{'server CPU s':>14}")
    ways: list[tuple[str, str | None, dict[str, str]]] = [
        ("S3 (moto), signed URLs: bytes from S3", s3, {}),
        ("S3 (moto), every byte through the server", s3, {"read_url_seconds": "0"}),
        ("local folder, sent with sendfile", None, {}),
        ("local folder, streamed in 1 MiB pieces", None, {"sendfile": "false"}),
    ]
    for number, (label, blobs, settings) in enumerate(ways):
        with served(root / f"readers-{number}", blobs, **settings) as (url, server):
            with Client(url) as ckpt:
                ckpt.save(RUN, model)
            before = cpu_seconds(server)
            started = time.perf_counter()
            procs = [
                subprocess.Popen([sys.executable, "-c", READER, url, RUN], stdout=subprocess.PIPE, text=True)
                for _ in range(readers)
            ]
            outputs = [proc.communicate()[0].split() for proc in procs]
            wall = time.perf_counter() - started
            spent = cpu_seconds(server) - before
        loaded = sum(int(out[1]) for out in outputs)
        slowest = max(float(out[0]) for out in outputs)
        print(f"{label:<44}{loaded / wall / 1e6:>16.0f}{slowest:>11.2f}{spent:>14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="MiB of the save/load model")
    parser.add_argument("--read-size", type=int, default=1024, help="MiB of the version the readers load")
    parser.add_argument("--readers", type=int, default=8, help="processes loading one version at once (0: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="128 MiB, 256 MiB read by 4 readers, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.size, args.read_size, args.readers, args.rounds = 128, 256, 4, 1
    print(f"cores: {os.cpu_count()}, torch {torch.__version__}")
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="ckptstore-bench-http-") as scratch, s3_stand_in() as s3:
        save_and_load(Path(scratch), s3, args.size * MIB, args.rounds)
        loop_saves(Path(scratch), args.size * MIB, args.rounds)
        if args.readers > 0:
            many_readers(Path(scratch), s3, args.read_size * MIB, args.readers)


if __name__ == "__main__":
    main()
