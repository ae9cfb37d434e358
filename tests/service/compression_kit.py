"""A small full fine-tune for the compression tests, and what they look at in a store.

A :class:`FineTune` is a model (bfloat16 or float32: an embedding of 2048 x 256 and two
256 x 256 layers) and its AdamW, trained a few real steps between saves, keeping a copy of
every state it saved so that loads are compared with it bit for bit, optimizer state included.
Every weight and moment is at least 64 KiB (:data:`service.reclaim.compression.MIN_BYTES`), so each
save adds nine tensors ``gc --compress`` re-encodes; the biases and step counts stay raw.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sqlalchemy import select
from torch import nn

from ckptstore import client
from ckptstore.client.store_protocol import Transport
from ckptstore.service.blobs import BlobStore
from ckptstore.service.db.models import Shard, Tensor, TensorNeed, Version
from ckptstore.service.format.encoded_reads import chain_of
from ckptstore.service.format.records import TensorLocation
from ckptstore.service.reclaim.compression import MIN_BYTES
from ckptstore.service.store import Store
from tests.client.models import tensors_equal

ROWS, WIDTH = 2048, 256
#: Keys of the tensors each save adds that compression re-encodes (weights and their moments).
LARGE_KEYS = tuple(
    [f"model/{layer}.weight" for layer in (0, 1, 3)]
    + [f"optim/state/{layer}.weight/{moment}" for layer in (0, 1, 3) for moment in ("exp_avg", "exp_avg_sq")]
)
#: The model weights: they move a little each step, so after the first version each is a delta.
WEIGHT_KEYS = LARGE_KEYS[:3]


def make_model(dtype: torch.dtype, seed: int) -> nn.Module:
    """The fine-tuned model, initialised from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Embedding(ROWS, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    return model.to(dtype)


@dataclass(frozen=True)
class Saved:
    """Copies of what one save held: the model's state and the optimizer's per-parameter state."""

    model: dict[str, torch.Tensor]
    optim: dict[int, dict[str, torch.Tensor]]


def _optim_state(optim: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    state = optim.state_dict()["state"]
    return {int(index): {name: value.clone() for name, value in values.items()} for index, values in state.items()}


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's operations on one thread meanwhile: on tensors this small a second thread
    gains nothing, and on a busy machine its spinning makes every operation several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class FineTune:
    """A model and its AdamW trained a few steps between saves; every saved state kept by version."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.dtype = dtype
        self.model = make_model(dtype, seed)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.generator = torch.Generator().manual_seed(seed)
        self.saved: dict[tuple[str, int], Saved] = {}

    def _train(self, steps: int) -> None:
        """Real steps: a forward pass over random tokens, backward, AdamW."""
        for _ in range(steps):
            tokens = torch.randint(0, ROWS, (64,), generator=self.generator)
            loss = self.model(tokens).float().pow(2).mean()
            loss.backward()
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)

    def save(self, ckpt: client.Client, run: str) -> int:
        """Train a few steps, save, remember what was saved; the version."""
        with one_thread():
            self._train(2)
            version = ckpt.save(run, self.model, self.optim).version
            state = {key: value.detach().clone() for key, value in self.model.state_dict().items()}
        self.saved[(run, version)] = Saved(state, _optim_state(self.optim))
        return version

    def save_versions(self, ckpt: client.Client, run: str, count: int) -> None:
        """:meth:`save` ``count`` times: that many versions, a few steps apart."""
        for _ in range(count):
            self.save(ckpt, run)

    def differences(self, ckpt: client.Client, run: str, version: int) -> list[str]:
        """What a load of ``run@version`` into a fresh model and AdamW got wrong (empty: bit for bit)."""
        with one_thread():
            return self._differences(ckpt, run, version)

    def _differences(self, ckpt: client.Client, run: str, version: int) -> list[str]:
        saved = self.saved[(run, version)]
        model = make_model(self.dtype, seed=12345)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        assert not all(tensors_equal(v, saved.model[k]) for k, v in model.state_dict().items())  # differs before
        ckpt.load(run, version, model=model, optim=optim)
        wrong = [key for key, value in model.state_dict().items() if not tensors_equal(value, saved.model[key])]
        loaded = optim.state_dict()["state"]
        if set(loaded) != set(saved.optim):
            return [*wrong, f"optimizer state of parameters {sorted(loaded)}, not {sorted(saved.optim)}"]
        for index, values in saved.optim.items():
            if set(loaded[index]) != set(values):
                wrong.append(f"optim/{index}: {sorted(loaded[index])}")
                continue
            wrong += [
                f"optim/{index}/{name}"
                for name, value in values.items()
                if not tensors_equal(loaded[index][name], value)
            ]
        return wrong

    def wrong_loads(self, ckpt: client.Client, run: str | None = None) -> dict[str, list[str]]:
        """Every saved version (of ``run``, or of every run) that does not load bit for bit, with what differs."""
        found = {}
        for saved_run, version in sorted(self.saved):
            if run is None or saved_run == run:
                wrong = self.differences(ckpt, saved_run, version)
                if wrong:
                    found[f"{saved_run}@{version}"] = wrong
        return found

    def forget(self, run: str, versions: Iterable[int]) -> None:
        """Stop checking versions that were deleted."""
        for version in versions:
            del self.saved[(run, version)]


# -- what the tests look at in a store --------------------------------------------------------


def open_client(
    store: Store, home: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> client.Client:
    """A client on the same store as ``store`` (the ``store`` fixture's): the embedded store in
    ``home`` for SQLite; for PostgreSQL, the store ``CKPTSTORE_DATABASE_URL`` and
    ``CKPTSTORE_BLOBS`` name, as a training process pointed at a server's database opens it."""
    if store.db.url.startswith("sqlite"):
        return client.Client(home=home)
    monkeypatch.setenv("CKPTSTORE_DATABASE_URL", request.getfixturevalue("pg_url"))
    monkeypatch.setenv("CKPTSTORE_BLOBS", store.blobs.location)
    monkeypatch.setenv("CKPTSTORE_HOME", str(home))
    return client.Client()


def keyed_digests(transport: Transport, run: str, version: int) -> dict[str, str]:
    """Key -> digest of every tensor of ``run@version`` stored whole."""
    manifest = transport.manifest(run, version)
    return {entry.key: entry.digest for entry in manifest.tensors if entry.digest is not None}


def large_digests(transport: Transport, run: str, version: int) -> dict[str, str]:
    """Key -> digest of the tensors of ``run@version`` large enough to be compressed."""
    digests = keyed_digests(transport, run, version)
    locations = transport.locate(digests.values())
    return {key: digest for key, digest in digests.items() if locations[digest].nbytes >= MIN_BYTES}


def deltas(locations: dict[str, TensorLocation], digest: str) -> int:
    """How many deltas decoding ``digest`` applies (0: stored whole, raw or compressed)."""
    return sum(1 for link in chain_of(locations, digest) if link.base is not None)


def blob_bytes(blobs: BlobStore) -> int:
    """The bytes the blob store holds."""
    return sum(blobs.size(blob_id) or 0 for blob_id in blobs.list_ids())


def shard_ids(store: Store) -> set[str]:
    """Every shard row's id."""
    with store.db.transaction() as session:
        return set(session.scalars(select(Shard.id)))


def uncompressed_versions(store: Store) -> list[tuple[str, int]]:
    """The versions no compressing collection has visited yet."""
    with store.db.transaction() as session:
        rows = session.execute(select(Version.run_id, Version.version).where(~Version.compressed))
        return sorted((run, int(version)) for run, version in rows)


def dangling_needs(store: Store) -> list[tuple[str, str]]:
    """``tensor_needs`` rows whose delta or needed tensor has no tensor row (should be none, ever)."""
    with store.db.transaction() as session:
        held = set(session.scalars(select(Tensor.digest)))
        rows = session.execute(select(TensorNeed.digest, TensorNeed.needs)).all()
    return [(digest, needs) for digest, needs in rows if digest not in held or needs not in held]


def need_rows(store: Store) -> int:
    """How many ``tensor_needs`` rows the store holds."""
    with store.db.transaction() as session:
        return len(session.execute(select(TensorNeed.digest)).all())


# -- an encoded shard pinned by one live payload ------------------------------------------------

FROZEN = "model/0.weight"
#: Above the share of its bytes the first version's shard keeps live (the frozen weights, about
#: 0.6 of it) and below 1: that shard, and only it, is a candidate.
BELOW = 0.9


def a_pinned_shard(store: Store, ckpt: client.Client) -> tuple[FineTune, str]:
    """Versions 1 and 2 compressed, version 3 saved raw, versions 1 and 2 deleted: the frozen
    weights are the one live payload of version 1's encoded shard. The tune, and that shard."""
    tune = FineTune(torch.bfloat16)
    tune.model[0].weight.requires_grad_(False)
    tune.save(ckpt, "run")
    tune.save(ckpt, "run")
    ckpt.gc(compress=True, grace_seconds=0)
    frozen = keyed_digests(store, "run", 1)[FROZEN]
    pinned = store.locate([frozen])[frozen]
    assert pinned.encoding == "grouped-zstd"
    tune.save(ckpt, "run")  # version 3 holds the frozen weights too: they stay where they are
    assert keyed_digests(store, "run", 3)[FROZEN] == frozen
    for version in (1, 2):
        ckpt.delete("run", version)
    tune.forget("run", [1, 2])
    ckpt.gc(grace_seconds=0)
    assert pinned.shard_id in shard_ids(store)  # one live payload keeps the shard
    return tune, pinned.shard_id


# -- a collection killed part-way ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
#: The start of a child's script: the store opened from the environment as ``ckptstore gc`` opens
#: it, and ``dying(call, before=)``, which wraps a function so that its Nth call (``argv[2]``)
#: kills the process with SIGKILL, before or after the call. ``argv[1]`` names the kill point.
KILLABLE_STORE = """
import os, signal, sys

import ckptstore.service.reclaim.compaction  # noqa: F401
import ckptstore.service.reclaim.compression  # noqa: F401
import ckptstore.service.reclaim.gc  # noqa: F401
from ckptstore import service
from ckptstore.service.factory import open_store
from ckptstore.service.settings import local_settings

point, nth = sys.argv[1], int(sys.argv[2])
store = open_store(local_settings())
calls = 0


def dying(call, *, before):
    def wrapped(*args, **kwargs):
        global calls
        calls += 1
        if before and calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        result = call(*args, **kwargs)
        if not before and calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapped


"""


def run_killed(script: str, point: str, nth: int, store: Store, home: Path) -> None:
    """Run ``script`` (:data:`KILLABLE_STORE` and what follows it) on the store in a child, and
    check that it died of SIGKILL at ``point``'s ``nth`` call."""
    env = {**os.environ, "CKPTSTORE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("CKPTSTORE_URL", None)
    if store.db.url.startswith("sqlite"):
        env.pop("CKPTSTORE_DATABASE_URL", None)
        env.pop("CKPTSTORE_BLOBS", None)
    else:
        assert env["CKPTSTORE_DATABASE_URL"].startswith("postgresql")  # set by open_client
    done = subprocess.run(
        [sys.executable, "-c", script, point, str(nth)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
