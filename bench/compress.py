"""Compression at rest (``gc --compress``): bytes stored, cold loads, collection speed, codec choice.

Trains a Llama (``transformers``, built from a config: random init, no download; embeddings tied
as in Llama 3.2 1B and GPT-2, so every row of the embedding is trained) as a full fine-tune:
AdamW lr 1e-4 on random tokens, a save of model and optimizer every 10 steps, 4 versions, once
with bf16 weights and once with fp32 weights. The bf16 model's gradients come from an fp32 copy
of its weights (bf16 matmuls on a CPU without bf16 units are ~10x slower); its weights and AdamW
state are bf16, as in pure-bf16 training. Each store is copied (its blob files hard-linked) before
``gc(compress=True, grace_seconds=0)``, so the same 4 saves exist uncompressed and compressed.
Prints, in one run:

1. **Storage.** Raw bytes against the bytes stored after the collection (each tensor's stored
   payload, from the store's own records), for the first version, each later version's added
   tensors, all 4 versions, and model weights against Adam moments; the blob files on disk. Also
   for a bf16 run saved after ``--later`` steps (200), when Adam's moments have settled.
2. **Loads.** The latest version, and version 1 (no deltas), into an existing model and
   optimizer, from the compressed and the uncompressed store, alternating, medians of 3: cold
   (every blob file of both stores evicted with ``posix_fadvise(DONTNEED)`` after ``sync`` before
   each load) and warm.
3. **Collection speed.** Raw bytes the compressing collection visited per second, in all and
   per core (``os.cpu_count()``), and per CPU-second it spent; it runs in a process of its own,
   as ``ckptstore gc --compress`` does, from a cold page cache; medians of ``--collections`` (3; the
   store the loads read, then fresh copies of the same uncompressed versions).
4. **Codec choice.** One thread compressing and decompressing the trained bf16 weights, Adam
   moments and an fp32 weight: ckptstore's byte-grouped zstd 1 (and its deltas) against
   zstd 3, zstd 1 without grouping and blosc2 (shuffle or bitshuffle + zstd 1) when it is
   installed (it is not a ckptstore dependency).

    .venv/bin/python bench/compress.py --quick          # ~4M parameters, < 1 minute
    .venv/bin/python bench/compress.py [--params 50]    # millions of parameters
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import transformers
import zstandard
from transformers import LlamaConfig, LlamaForCausalLM

from ckptstore.client import Client
from ckptstore.service.format import encoding
from ckptstore.service.format.records import GcReport, TensorLocation
from ckptstore.service.reclaim import compression
from ckptstore.service.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import files_under, fresh_folder, scratch_dir, timed  # noqa: E402

RUN = "finetune"
VERSIONS = 4
STEPS_PER_VERSION = 10
TOKENS_PER_STEP = 16
MB = 1e6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WHAT = ("model weights", "Adam exp_avg", "Adam exp_avg_sq", "other (step counts)")


def progress(message: str) -> None:
    """A progress line on stderr, only when a person is watching."""
    if sys.stderr.isatty():
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verdict(value: float, target: float, floor: float, *, higher_is_better: bool = False) -> str:
    """Whether ``value`` meets the target, only the floor, or neither."""
    sign = -1 if higher_is_better else 1
    if sign * value <= sign * target:
        return f"target {target:.2f}x met"
    gap = abs(value - target)
    if sign * value <= sign * floor:
        return f"target {target:.2f}x missed by {gap:.2f} (floor {floor:.2f}x held)"
    return f"MISSED floor {floor:.2f}x (target {target:.2f}x) by {abs(value - floor):.2f}"


# --------------------------------------------------------------------------------------
# The model and its training
# --------------------------------------------------------------------------------------


def llama_config(params_m: float) -> LlamaConfig:
    """A tied-embedding Llama of about ``params_m`` million parameters (width fixed, depth fitted)."""
    widths = [(20, (256, 8000, 688, 4)), (80, (512, 32000, 1376, 8))]
    hidden, vocab, inter, heads = next((w for below, w in widths if params_m < below), (768, 32000, 2048, 12))
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params_m * 1e6 - vocab * hidden) / per_layer))
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip


@dataclass
class Trained:
    """One dtype's run: the model and optimizer as the last save left them, and the stores."""

    dtype: str
    model: LlamaForCausalLM
    optim: torch.optim.Optimizer
    home: Path  # compressed by the collection
    raw_home: Path  # the same saves, never compressed
    train_seconds: float
    weights_v3: dict[str, torch.Tensor] = field(default_factory=dict)
    warmup: int = 0  # steps trained before the first save

    @property
    def label(self) -> str:
        """The run as the tables name it: its dtype, and where its saves begin if not at once."""
        return f"{self.dtype}, saved after {self.warmup} steps" if self.warmup else self.dtype


def train(config: LlamaConfig, dtype: str, root: Path, warmup: int = 0) -> Trained:
    """Train ``warmup`` steps, then save ``VERSIONS`` versions into a fresh store under ``root``; copy the store."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DTYPES[dtype])
    # The bf16 model's gradients come from an fp32 copy of its current weights (see the docstring).
    compute = copy.deepcopy(model).float() if dtype == "bf16" else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on 2 shared cores, two OpenMP threads spin-wait: 3-10x slower steps here
    home = fresh_folder(root / f"{dtype}-{warmup}-compressed")
    trained = Trained(dtype, model, optim, home, root / f"{dtype}-{warmup}-uncompressed", 0.0, warmup=warmup)
    started = time.perf_counter()
    with Client(home=home) as ckpt:
        for step in range(1, warmup + VERSIONS * STEPS_PER_VERSION + 1):
            if compute is not model:
                with torch.no_grad():
                    for mine, theirs in zip(compute.parameters(), model.parameters(), strict=True):
                        mine.copy_(theirs)
            ids = torch.randint(0, config.vocab_size, (1, TOKENS_PER_STEP), generator=tokens)
            compute(input_ids=ids, labels=ids).loss.backward()
            if compute is not model:
                for mine, theirs in zip(compute.parameters(), model.parameters(), strict=True):
                    if theirs.grad is None:
                        theirs.grad = mine.grad.to(theirs.dtype)
                    else:
                        theirs.grad.copy_(mine.grad)
                compute.zero_grad(set_to_none=False)
            optim.step()
            optim.zero_grad(set_to_none=False)  # gradients stay allocated: no fresh pages every step
            number, due = divmod(step - warmup, STEPS_PER_VERSION)
            if step > warmup and due == 0:
                ckpt.save(RUN, model, optim, step=step)
                if number == VERSIONS - 1:
                    trained.weights_v3 = {k: v.detach().clone() for k, v in model.state_dict().items()}
                progress(f"{trained.label}: saved version {number}")
    trained.train_seconds = time.perf_counter() - started
    torch.set_num_threads(threads)
    linked_copy(home, trained.raw_home)  # the uncompressed store
    return trained


def linked_copy(home: Path, copy: Path) -> None:
    """A copy of the store at ``home``: its own database, the same blob files (hard links: shards
    are written once and never changed; a collection writes new ones and unlinks the copy's)."""
    shutil.copytree(home, copy, ignore=shutil.ignore_patterns("blobs"))
    shutil.copytree(home / "blobs", copy / "blobs", copy_function=os.link)


# --------------------------------------------------------------------------------------
# 1. Storage: what the store records for each tensor
# --------------------------------------------------------------------------------------


def what_of(key: str) -> str:
    """Which of WHAT a manifest key holds."""
    if key.startswith("model/"):
        return WHAT[0]
    if key.endswith("/exp_avg"):
        return WHAT[1]
    return WHAT[2] if key.endswith("/exp_avg_sq") else WHAT[3]


@dataclass
class Accounting:
    """Each version's tensors, by digest, with what each holds and where it is stored."""

    versions: list[dict[str, str]]  # per version: digest -> WHAT
    locations: dict[str, TensorLocation]

    @classmethod
    def of(cls, home: Path) -> Accounting:
        store = Store.open_home(home)
        try:
            versions = []
            for number in range(1, VERSIONS + 1):
                found: dict[str, str] = {}
                for entry in store.manifest(RUN, number).tensors:
                    digests = [entry.digest] if entry.digest else [c.digest for c in entry.chunks or ()]
                    found.update(dict.fromkeys(digests, what_of(entry.key)))
                versions.append(found)
            locations = store.locate({d for v in versions for d in v})
            bases = {loc.base for loc in locations.values() if loc.base}
            while bases - locations.keys():  # a delta's base outside these versions (none expected)
                locations.update(store.locate(bases - locations.keys()))
                bases = {loc.base for loc in locations.values() if loc.base}
        finally:
            store.close()
        return cls(versions, locations)

    def added(self, number: int) -> dict[str, str]:
        """The tensors version ``number`` (1-based) holds that no earlier version does."""
        earlier = {d for v in self.versions[: number - 1] for d in v}
        return {d: w for d, w in self.versions[number - 1].items() if d not in earlier}

    def everything(self) -> dict[str, str]:
        return {d: w for v in self.versions for d, w in v.items()}

    def raw(self, digests: Iterable[str]) -> int:
        return sum(self.locations[d].nbytes for d in digests)

    def stored(self, digests: Iterable[str]) -> int:
        return sum(self.locations[d].length for d in digests)

    def deltas(self, digests: dict[str, str]) -> str:
        encoded = [d for d in digests if self.locations[d].encoding != "raw"]
        xor = sum(1 for d in encoded if self.locations[d].base)
        return f"{len(encoded)} of {len(digests)} encoded, {xor} as deltas"

    def read_closure(self, digests: dict[str, str]) -> set[str]:
        """``digests`` and every base their decoding reads."""
        found, todo = set(), list(digests)
        while todo:
            digest = todo.pop()
            if digest not in found:
                found.add(digest)
                base = self.locations[digest].base
                if base:
                    todo.append(base)
        return found


def blob_bytes(home: Path) -> int:
    return sum(path.stat().st_size for path in files_under(home / "blobs"))


def storage_rows(trained: Trained, books: Accounting, raw_books: Accounting) -> list[str]:
    """Section 1's rows for one dtype."""
    rows = []

    def row(what: str, digests: dict[str, str], target: str = "") -> None:
        raw, stored = books.raw(digests), books.stored(digests)
        assert raw == raw_books.raw(digests), "the compressed and uncompressed stores disagree"
        shown = f"| {trained.label} | {what} | {raw / MB:,.1f} | {stored / MB:,.1f} | {stored / raw:.3f}x"
        rows.append(f"{shown} | {books.deltas(digests)} | {target} |")

    # #34's targets are the model's versions, as its prototype measured them (a first version in
    # 0.69x, deltas 10 steps apart in 0.30-0.41x: four versions in about 0.44x, hence 0.45x); the
    # optimizer's moments are measured and reported beside them.
    bf16 = trained.dtype == "bf16"
    first = books.added(1)
    row("version 1 alone", first)
    weights = {d: w for d, w in first.items() if w == WHAT[0]}
    if weights:
        target = verdict(books.stored(weights) / books.raw(weights), 0.70, 0.72) if bf16 else "measured"
        row(f"version 1 alone: {WHAT[0]}", weights, target)
    for number in range(2, VERSIONS + 1):
        row(f"what version {number} added", books.added(number))
    every = books.everything()
    row(f"all {VERSIONS} versions (model and optimizer)", every, "measured")
    for what in WHAT:
        part = {d: w for d, w in every.items() if w == what}
        target = "measured"
        if bf16 and what == WHAT[0] and part:
            target = verdict(books.stored(part) / books.raw(part), 0.45, 0.55)
        row(f"{VERSIONS} versions: {what}", part, target)
    on_disk, raw_disk = blob_bytes(trained.home), blob_bytes(trained.raw_home)
    rows.append(
        f"| {trained.label} | blob files on disk (shard headers included) | {raw_disk / MB:,.1f} "
        f"| {on_disk / MB:,.1f} | {on_disk / raw_disk:.3f}x | after a second gc (grace 0) | |"
    )
    return rows


# --------------------------------------------------------------------------------------
# 2. Loads, cold and warm
# --------------------------------------------------------------------------------------


def evict(homes: list[Path]) -> None:
    """Write back, then drop every blob file of ``homes`` from the page cache."""
    os.sync()
    for home in homes:
        for path in files_under(home / "blobs"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_target(trained: Trained, config: LlamaConfig) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    """A model and an AdamW with state of the trained ones' shapes, for loads to fill."""
    model = LlamaForCausalLM(config).to(DTYPES[trained.dtype])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    optim.load_state_dict(copy.deepcopy(trained.optim.state_dict()))  # own tensors, not the trained ones
    return model, optim


def clear(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Zero every tensor of the target, so each load writes every value (and a check means something)."""
    with torch.no_grad():
        for tensor in [*model.state_dict().values(), *(v for s in optim.state.values() for v in s.values())]:
            tensor.zero_()


def snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of ``model`` and ``optim``, in a fixed order (views, not copies)."""
    found = list(model.state_dict().values())
    for param in model.parameters():
        state = optim.state[param]
        found += [state[k] for k in sorted(state)]
    return found


def same(expected: list[torch.Tensor], model: torch.nn.Module, optim: torch.optim.Optimizer) -> bool:
    """True when ``model`` and ``optim`` hold exactly ``expected`` (a :func:`snapshot`)."""
    found = snapshot(model, optim)
    return len(found) == len(expected) and all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))


#: What a load's time is filed under: (version, store, page cache).
LoadKey = tuple[int, str, str]


def load_times(trained: Trained, config: LlamaConfig, repeats: int) -> dict[LoadKey, list[float]]:
    """Seconds of each load of the latest version and of version 1 (its tensors are all stored
    whole: no delta to apply), the two stores alternating, cold before warm."""
    model, optim = load_target(trained, config)
    homes = [trained.raw_home, trained.home]
    found: dict[LoadKey, list[float]] = {}
    with Client(home=trained.raw_home) as raw, Client(home=trained.home) as packed:
        clients = {"uncompressed": raw, "compressed": packed}
        for version in (VERSIONS, 1):
            # Checked against the trained state, or for version 1 against the uncompressed store's load.
            expected = snapshot(trained.model, trained.optim) if version == VERSIONS else None
            for cache in ("cold", "warm"):
                for number in range(repeats):
                    for name in list(clients) if number % 2 == 0 else list(reversed(clients)):
                        clear(model, optim)
                        if cache == "cold":
                            evict(homes)
                        load = clients[name].load
                        seconds, _ = timed(lambda load=load, v=version: load(RUN, v, model=model, optim=optim))
                        found.setdefault((version, name, cache), []).append(seconds)
                        if expected is None:
                            expected = [t.clone() for t in snapshot(model, optim)]
                        elif cache == "cold" and number == 0 and not same(expected, model, optim):
                            raise SystemExit(f"{trained.dtype}: the {name} store loaded other values than were saved")
                    progress(f"{trained.dtype}: version {version}, {cache} loads, round {number + 1}")
    return found


def load_rows(trained: Trained, books: Accounting, times: dict[LoadKey, list[float]]) -> list[str]:
    rows = []
    for version in (VERSIONS, 1):
        tensors = books.versions[version - 1]
        nbytes = books.raw(tensors)
        read = books.stored(books.read_closure(tensors))
        label = "latest" if version == VERSIONS else "first (no deltas)"
        for cache in ("cold", "warm"):
            raw_times, packed_times = times[(version, "uncompressed", cache)], times[(version, "compressed", cache)]
            raw_s, packed_s = statistics.median(raw_times), statistics.median(packed_times)
            ratio = raw_s / packed_s  # throughput ratio: the same bytes land in both
            check = verdict(ratio, 0.8, 0.6, higher_is_better=True) if cache == "cold" and version == VERSIONS else ""
            rows.append(
                f"| {trained.dtype} | {version}, {label} | {cache} | {nbytes / MB:,.0f} | {raw_s:.2f} "
                f"({', '.join(f'{s:.2f}' for s in raw_times)}) | {nbytes / raw_s / MB:,.0f} | {read / MB:,.0f} "
                f"| {packed_s:.2f} ({', '.join(f'{s:.2f}' for s in packed_times)}) | {nbytes / packed_s / MB:,.0f} "
                f"| {ratio:.2f}x | {check} |"
            )
    return rows


# --------------------------------------------------------------------------------------
# 3. The compressing collection
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def pass_timer() -> Iterator[list[float]]:
    """Wall seconds of the compression pass within a collection (:func:`service.reclaim.compression.compress`)."""
    original = compression.compress
    spent: list[float] = []

    def compress(*args: object, **kwargs: object) -> compression.Compression:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent.append(time.perf_counter() - started)

    compression.compress = compress
    try:
        yield spent
    finally:
        compression.compress = original


@dataclass
class Collection:
    report: GcReport
    wall: float
    pass_wall: float
    cpu: float


def collect(home: Path) -> Collection:
    """``gc(compress=True, grace_seconds=0)`` timed in a process of its own, as ``ckptstore gc
    --compress`` runs, from a cold page cache (a collection visits versions long after they were
    saved)."""
    evict([home])
    out = subprocess.run(
        [sys.executable, __file__, "--collect", str(home)], check=True, capture_output=True, text=True
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    return Collection(GcReport(**found["report"]), found["wall"], found["pass_wall"], found["cpu"])


def collections_of(trained: Trained, root: Path, times: int) -> list[Collection]:
    """:func:`collect` of the store the loads read, then of ``times - 1`` fresh copies of the
    uncompressed one (its blob files hard-linked): this machine's speed moves up to twofold from
    one collection to the next, so the row gives the median."""
    done = [collect(trained.home)]
    for number in range(1, times):
        home = root / f"{trained.dtype}-{trained.warmup}-collected-{number}"
        shutil.rmtree(home, ignore_errors=True)
        linked_copy(trained.raw_home, home)
        try:
            done.append(collect(home))
        finally:
            shutil.rmtree(home, ignore_errors=True)
    return done


def collect_here(home: Path) -> None:
    """The timed collection of :func:`collect`, printed as one JSON line (the child process's part)."""
    with Client(home=home) as ckpt, pass_timer() as spent:
        cpu = time.process_time()
        wall, report = timed(lambda: ckpt.gc(compress=True, grace_seconds=0))
        cpu = time.process_time() - cpu
        ckpt.gc(grace_seconds=0)  # sweeps what the first left in grace, for the on-disk row
    if not spent:
        raise SystemExit("the collection no longer calls service.reclaim.compression.compress: update pass_timer")
    print(json.dumps({"report": report.model_dump(), "wall": wall, "pass_wall": sum(spent), "cpu": cpu}))


def collection_rows(dtype: str, books: Accounting, done: list[Collection]) -> list[str]:
    cores = os.cpu_count() or 1
    visited = books.raw(d for d in books.everything() if books.locations[d].nbytes >= compression.MIN_BYTES)
    report = done[0].report
    pass_wall = statistics.median(c.pass_wall for c in done)
    wall, cpu = statistics.median(c.wall for c in done), statistics.median(c.cpu for c in done)
    per_core = visited / pass_wall / MB / cores
    runs = ", ".join(f"{c.pass_wall:.2f}" for c in done)
    return [
        f"| {dtype} | {visited / MB:,.0f} | {report.bytes_before_compression / MB:,.0f} "
        f"| {report.bytes_after_compression / MB:,.0f} | {pass_wall:.2f} ({runs}) | {wall:.2f} "
        f"| {visited / pass_wall / MB:,.0f} | {per_core:,.0f} | {visited / cpu / MB:,.0f} "
        f"| {'target 200 met' if per_core >= 200 else f'target 200 MISSED by {200 - per_core:.0f}'} |"
    ]


# --------------------------------------------------------------------------------------
# 4. Codecs, one thread each
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    name: str
    pack: Callable[[memoryview, int], bytes]
    unpack: Callable[[bytes, memoryview, int], None]  # into a buffer of the raw length


def _ckptstore_unpack(payload: bytes, out: memoryview, width: int) -> None:
    head = encoding.parse_head(payload, nbytes=out.nbytes, width=width, subject="bench")
    encoding.decode_chain([(head, payload)], out, subject="bench")


def codecs() -> tuple[list[Codec], str]:
    found = [
        Codec("ckptstore: byte-grouped zstd 1, 1 MiB blocks", encoding.encode, _ckptstore_unpack),
        Codec(
            "byte-grouped zstd 3, 1 MiB blocks",
            lambda data, width: encoding.encode(data, width, level=3),
            _ckptstore_unpack,
        ),
        Codec(
            "zstd 1 without grouping, 1 MiB blocks",
            lambda data, width: encoding.encode(data, 1),
            lambda payload, out, width: _ckptstore_unpack(payload, out, 1),
        ),
    ]
    try:
        import blosc2
    except ImportError:
        return found, "blosc2: not installed"
    for label, kind in (("shuffle", blosc2.Filter.SHUFFLE), ("bitshuffle", blosc2.Filter.BITSHUFFLE)):

        def pack(data: memoryview, width: int, kind: blosc2.Filter = kind) -> bytes:
            params = blosc2.CParams(
                codec=blosc2.Codec.ZSTD, clevel=1, typesize=width, filters=[kind], filters_meta=[0], nthreads=1
            )
            return bytes(blosc2.compress2(data, cparams=params))

        def unpack(payload: bytes, out: memoryview, width: int) -> None:
            blosc2.decompress2(payload, dst=out, dparams=blosc2.DParams(nthreads=1))

        found.append(Codec(f"blosc2 {blosc2.__version__}: {label} + zstd 1 (blocks auto)", pack, unpack))
    return found, f"blosc2 {blosc2.__version__}: installed (not a ckptstore dependency)"


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(torch.uint8).numpy())


def codec_rows(label: str, tensors: list[torch.Tensor], codec: Codec, rounds: int) -> str:
    """One thread packing and unpacking ``tensors``, the faster of ``rounds`` each."""
    views = [byte_view(t) for t in tensors]
    width = tensors[0].element_size()
    nbytes = sum(v.nbytes for v in views)
    pack_s, unpack_s = [], []
    for _ in range(rounds):
        seconds, payloads = timed(lambda: [codec.pack(v, width) for v in views])
        pack_s.append(seconds)
        outs = [np.empty(v.nbytes, dtype=np.uint8) for v in views]
        pairs = list(zip(payloads, outs, strict=True))
        seconds, _ = timed(lambda: [codec.unpack(p, memoryview(o), width) for p, o in pairs])  # noqa: B023
        unpack_s.append(seconds)
        same_bytes = (np.array_equal(o, np.frombuffer(v, dtype=np.uint8)) for o, v in zip(outs, views, strict=True))
        assert all(same_bytes), codec.name
    size = sum(len(p) for p in payloads)
    return (
        f"| {label} | {codec.name} | {size / nbytes:.3f}x | {nbytes / min(pack_s) / MB:,.0f} "
        f"| {nbytes / min(unpack_s) / MB:,.0f} |"
    )


def delta_row(
    label: str, tensors: list[torch.Tensor], bases: list[torch.Tensor], rounds: int, delta: Literal["diff", "xor"]
) -> str:
    """A ckptstore delta (the difference gc writes, or the XOR earlier stores hold): packing
    against the base, unpacking onto a copy of the base's bytes."""
    views, base_views = [byte_view(t) for t in tensors], [byte_view(t) for t in bases]
    width = tensors[0].element_size()
    nbytes = sum(v.nbytes for v in views)
    pack_s, unpack_s = [], []
    for _ in range(rounds):
        seconds, payloads = timed(
            lambda: [
                encoding.encode(v, width, base=b, base_digest="0" * 63 + "1", delta=delta)
                for v, b in zip(views, base_views, strict=True)
            ]
        )
        pack_s.append(seconds)
        outs = [np.frombuffer(b, dtype=np.uint8).copy() for b in base_views]
        heads = [
            encoding.parse_head(p, nbytes=o.nbytes, width=width, subject="bench")
            for p, o in zip(payloads, outs, strict=True)
        ]
        seconds, _ = timed(
            lambda: [
                encoding.decode_chain([(h, p)], memoryview(o), subject="bench")
                for h, p, o in zip(heads, payloads, outs, strict=True)  # noqa: B023
            ]
        )
        unpack_s.append(seconds)
        assert all(np.array_equal(o, np.frombuffer(v, dtype=np.uint8)) for o, v in zip(outs, views, strict=True))
    size = sum(len(p) for p in payloads)
    what = "difference (gc writes)" if delta == "diff" else "XOR (earlier stores)"
    return (
        f"| {label} | ckptstore: {what} delta against version 3, then as above | {size / nbytes:.3f}x "
        f"| {nbytes / min(pack_s) / MB:,.0f} | {nbytes / min(unpack_s) / MB:,.0f} |"
    )


def capped(tensors: list[torch.Tensor], cap: float) -> list[torch.Tensor]:
    """The tensors of at least 64 KiB (what the collection encodes), in order, up to ``cap`` bytes."""
    found: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor.nbytes >= compression.MIN_BYTES and sum(t.nbytes for t in found) + tensor.nbytes <= cap:
            found.append(tensor)
    return found


def codec_table(runs: dict[str, Trained], rounds: int) -> list[str]:
    found, blosc_line = codecs()
    rows = [
        f"{blosc_line}. One thread (per core); MB/s of raw bytes; the faster of {rounds} rounds.",
        "",
        "| data | codec | stored/raw | compress MB/s | decompress MB/s |",
        "|---|---|---:|---:|---:|",
    ]
    samples: list[tuple[str, list[torch.Tensor], list[torch.Tensor] | None]] = []
    if "bf16" in runs:
        trained = runs["bf16"]
        state = trained.model.state_dict()
        keys = list(dict.fromkeys({v.data_ptr(): k for k, v in state.items()}.values()))  # the tied embedding once
        weights = capped([state[k] for k in keys], float("inf"))
        v3 = [trained.weights_v3[k] for k in keys if state[k].nbytes >= compression.MIN_BYTES]
        samples.append((f"bf16 weights ({len(weights)} tensors)", weights, v3))
        params = list(trained.model.parameters())
        for name in ("exp_avg", "exp_avg_sq"):
            moments = capped([trained.optim.state[p][name] for p in params], 64 * MB)
            samples.append((f"bf16 Adam {name} ({len(moments)} tensors)", moments, None))
    if "fp32" in runs:
        samples.append(("fp32 embedding weight", [runs["fp32"].model.get_input_embeddings().weight], None))
    for label, tensors, bases in samples:
        label = f"{label}, version 4, {sum(t.nbytes for t in tensors) / MB:,.0f} MB"
        for codec in found:
            rows.append(codec_rows(label, tensors, codec, rounds))
            progress(f"codec {codec.name} on {label}")
        if bases is not None:
            rows.extend(delta_row(label, tensors, bases, rounds, delta) for delta in ("diff", "xor"))
    return rows


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores ({model}), load average {load} at start, no GPU used"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50, help="millions of model parameters (default 50)")
    parser.add_argument("--quick", action="store_true", help="~4M parameters, 1 codec round: a smoke test")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--repeats", type=int, default=3, help="loads timed per store and cache state")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch parent on a real disk")
    parser.add_argument("--keep", action="store_true", help="keep the stores (to profile them) and say where")
    parser.add_argument(
        "--later",
        type=int,
        default=200,
        help="also store bf16 versions saved after this many steps (moments past their first steps); 0: skip",
    )
    parser.add_argument("--collections", type=int, default=3, help="collections timed per dtype (median)")
    parser.add_argument("--collect", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collect is not None:
        collect_here(args.collect)
        return
    params = 4.0 if args.quick else args.params
    rounds = 1 if args.quick else 2
    config = llama_config(params)
    print(f"`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`\n")
    print(f"- machine: {machine()}")
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, zstandard {zstandard.__version__}"
    print(f"- {versions}")
    with torch.device("meta"):
        nparams = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    print(
        f"- model: Llama, {nparams / 1e6:.1f}M parameters (hidden {config.hidden_size}, {config.num_hidden_layers} "
        f"layers, vocab {config.vocab_size}, tied embeddings), random init; AdamW lr 1e-4 (fused), "
        f"{TOKENS_PER_STEP} random tokens a step; a save of model + optimizer every {STEPS_PER_VERSION} steps, "
        f"{VERSIONS} versions; then `gc(compress=True, grace_seconds=0)` (store deltas_per_keyframe 4)"
    )
    root = scratch_dir(args.workdir)
    try:
        runs: dict[str, Trained] = {}
        books: dict[str, tuple[Accounting, Accounting]] = {}
        collections: dict[str, list[Collection]] = {}
        loads: dict[str, dict[LoadKey, list[float]]] = {}
        for dtype in args.dtypes.split(","):
            progress(f"{dtype}: training")
            runs[dtype] = trained = train(config, dtype, root)
            gc.collect()
            gc.freeze()  # what lives now lives to the end: the collection each timed() runs first stays short
            progress(f"{dtype}: gc --compress")
            collections[dtype] = collections_of(trained, root, args.collections)
            books[dtype] = (Accounting.of(trained.home), Accounting.of(trained.raw_home))
            loads[dtype] = load_times(trained, config, args.repeats)
        later = None
        if args.later and "bf16" in runs and not args.quick:
            progress(f"bf16: training {args.later} steps before the first save")
            later = train(config, "bf16", root, warmup=args.later)
            collect(later.home)
            later_books = (Accounting.of(later.home), Accounting.of(later.raw_home))
        everyone = [*runs.values(), *([later] if later else [])]
        trainings = ", ".join(f"{t.label} {t.train_seconds:.0f} s" for t in everyone)
        print(f"- training and saving (not a measurement): {trainings}; scratch on {root}\n")

        print("## 1. Storage: raw bytes against bytes stored after `gc --compress`\n")
        print("Raw: each distinct tensor's bytes, as the uncompressed store holds them (a tensor two versions share")
        print("counts once); stored: its payload after the collection (the store's `TensorLocation.length`).")
        print("The issue's targets are the model's bf16 versions, as its prototype measured them; Adam's moments")
        print("are reported beside them (young moments are near their entropy: see bench/RESULTS.md).\n")
        print("| dtype | what | raw MB | stored MB | stored/raw | tensors | issue target |")
        print("|---|---|---:|---:|---:|---|---|")
        for dtype, trained in runs.items():
            print("\n".join(storage_rows(trained, *books[dtype])))
        if later is not None:
            print("\n".join(storage_rows(later, *later_books)))
            print(
                f"\nThe first runs save from step {STEPS_PER_VERSION}, while Adam's moments are young: `exp_avg_sq`,"
                "\na sum over the steps so far, still grows by a third to twofold from one save to the next, and its"
                f"\nexponents change. The run saved after {args.later} steps has settled moments, as a fine-tune's"
                "\nlater checkpoints do (its storage only)."
            )

        print(f"\n## 2. Loads into an existing model and optimizer, medians of {args.repeats}\n")
        print("The latest version (its weights deltas on their keyframes in version 1), and version 1 (every")
        print("tensor stored whole). Cold: both stores' blob files evicted (`sync`, then `posix_fadvise(DONTNEED)`")
        print("on each) before each load; warm: right after. Each load is checked bit for bit once. Throughput:")
        print("the version's raw bytes over the load's wall time. MB read: the payloads the compressed store reads,")
        print("delta bases included.\n")
        print(
            "| dtype | version | page cache | version MB | uncompressed s (runs) | MB/s | compressed: MB read "
            "| compressed s (runs) | MB/s | compressed/uncompressed throughput | target (cold, latest) |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for dtype, trained in runs.items():
            print("\n".join(load_rows(trained, books[dtype][0], loads[dtype])))

        cores = os.cpu_count() or 1
        print(f"\n## 3. `gc(compress=True, grace_seconds=0)` throughput ({cores} cores, cold page cache)\n")
        print("Visited: raw bytes of every tensor of at least 64 KiB the 4 versions hold (each is read and")
        print("encoded, then kept if it saves 3%); the pass: the compression pass alone, inside the whole collection")
        print("(which also compacts and sweeps), in a process of its own as `ckptstore gc --compress` runs. Per core:")
        print("pass MB/s / os.cpu_count(); per CPU-second: all threads of that process during the whole collection.")
        print(f"Medians of {args.collections} collections: the store the loads read, then fresh copies of its")
        print("uncompressed versions (the passes of each in brackets).\n")
        print(
            "| dtype | visited MB | re-encoded MB | stored as MB | pass s (runs) | whole gc s | pass MB/s "
            "| MB/s per core | MB per CPU-second | target per core |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for dtype in runs:
            print("\n".join(collection_rows(dtype, books[dtype][0], collections[dtype])))

        print("\n## 4. Codec choice\n")
        print("\n".join(codec_table(runs, rounds)))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
