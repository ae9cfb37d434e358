"""One flipped bit anywhere in a stored shard is caught: never a silently wrong tensor.

A TinyNet and its AdamW state are saved once. Then, one at a time, a bit of the stored shard is
flipped on disk, a load and ``ckptstore verify`` run, and the bit is flipped back. A flip in the
tensor data must fail the load with IntegrityError and make verify exit 1, every time. A flip in
the length prefix or JSON header (which loads never read: the metadata database says where each
tensor is) must make verify exit 1, and the load must either fail or return exactly the saved
tensors. The flipped bytes are each tensor's first and last byte plus a random sample, embedded
(fast, 100+ flips) and, for a smaller sample, through a real server.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from ckptstore import client
from ckptstore.client.cli import app as cli_app
from ckptstore.service.api import create_app
from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.errors import CheckpointError, IntegrityError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.client.models import TinyNet, tensors_equal, train
from tests.servers import running_server

pytestmark = pytest.mark.slow  # flips hundreds of bits, loading and verifying after each

RANDOM_DATA_FLIPS = 112  # plus each stored tensor's first and last byte
RANDOM_HEADER_FLIPS = 40  # plus the first and last byte of the prefix and of the JSON text
HTTP_DATA_FLIPS = 10
HTTP_HEADER_FLIPS = 4


@dataclass
class Saved:
    """A saved version, where its one shard lives on disk, and what each byte of it holds."""

    home: Path
    shard: Path
    data_start: int
    size: int
    owner: dict[int, set[str]]  # data byte offset -> keys of the tensor stored there
    model: TinyNet
    optim: torch.optim.Optimizer

    def tensor_edges(self) -> list[int]:
        """The first and last byte of every stored tensor."""
        starts: dict[frozenset[str], list[int]] = {}
        for offset, keys in self.owner.items():
            starts.setdefault(frozenset(keys), []).append(offset)
        return sorted({f(offsets) for offsets in starts.values() for f in (min, max)})


def new_target() -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet(seed=7)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[Saved]:
    home = tmp_path / "home"
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    with client.Client(home=home) as ckpt:
        ckpt.save("run", model, optim, step=2)
        store = ckpt.transport
        assert isinstance(store, Store) and isinstance(store.blobs, LocalBlobStore)
        manifest = store.manifest("run")
        keys: dict[str, set[str]] = {}
        for entry in manifest.tensors:
            if entry.digest is not None and entry.nbytes:
                keys.setdefault(entry.digest, set()).add(entry.key)
        locations = store.locate(list(keys))
        # A save packs frozen tensors (BatchNorm's statistics) apart from the rest: bits are
        # flipped in the shard of the trainable weights and optimizer state, the larger one.
        shards = list(store.blobs.list_ids())
        assert len(shards) == 2
        shard_id = max(shards, key=lambda s: sum(loc.nbytes for loc in locations.values() if loc.shard_id == s))
        owner: dict[int, set[str]] = {}
        for digest, location in locations.items():
            if location.shard_id != shard_id:
                continue
            for offset in range(location.offset, location.offset + location.nbytes):
                owner[offset] = keys[digest]
    shard = home / "blobs" / shard_id[:2] / shard_id
    size = shard.stat().st_size
    data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    # Every data byte belongs to a tensor, so every data flip must be caught.
    assert sorted(owner) == list(range(data_start, size))
    yield Saved(home, shard, data_start, size, owner, model, optim)


@contextmanager
def flipped(path: Path, position: int, bit: int) -> Iterator[None]:
    """Flip one bit of the file in place, behind the store's back; flip it back afterwards."""

    def toggle() -> None:
        with open(path, "r+b") as handle:
            handle.seek(position)
            byte = handle.read(1)[0]
            handle.seek(position)
            handle.write(bytes([byte ^ (1 << bit)]))

    toggle()
    try:
        yield
    finally:
        toggle()


def verify(env: dict[str, str | None]) -> Result:
    result = CliRunner().invoke(cli_app, ["verify"], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def load_into_fresh(ckpt: client.Client) -> tuple[TinyNet, torch.optim.Optimizer]:
    model, optim = new_target()
    ckpt.load("run", model=model, optim=optim)
    return model, optim


def same_as_saved(saved: Saved, model: TinyNet, optim: torch.optim.Optimizer) -> bool:
    """Every model tensor and every optimizer state tensor equals the saved one, bit for bit."""
    expected, actual = saved.model.state_dict(), model.state_dict()
    if expected.keys() != actual.keys() or not all(tensors_equal(expected[k], actual[k]) for k in expected):
        return False
    saved_state, loaded_state = saved.optim.state_dict()["state"], optim.state_dict()["state"]
    return saved_state.keys() == loaded_state.keys() and all(
        tensors_equal(saved_state[p][name], loaded_state[p][name]) for p in saved_state for name in saved_state[p]
    )


def check_data_flips(saved: Saved, ckpt: client.Client, env: dict[str, str | None], positions: list[int]) -> None:
    """Each flip fails the load with IntegrityError naming its tensor, and makes verify exit 1."""
    rng = random.Random(len(positions))
    missed: list[str] = []
    for position in positions:
        bit = rng.randrange(8)
        with flipped(saved.shard, position, bit):
            try:
                load_into_fresh(ckpt)
                missed.append(f"byte {position} bit {bit}: load returned")
            except IntegrityError as exc:
                if not any(key in str(exc) for key in saved.owner[position]):
                    missed.append(f"byte {position} bit {bit}: load blamed another tensor: {exc}")
            result = verify(env)
            if result.exit_code != 1 or saved.shard.name not in result.stdout:
                missed.append(f"byte {position} bit {bit}: verify exited {result.exit_code}")
    assert not missed, f"{len(missed)} of {len(positions)} data flips missed:\n" + "\n".join(missed)


def check_header_flips(saved: Saved, ckpt: client.Client, env: dict[str, str | None], positions: list[int]) -> None:
    """Each flip makes verify exit 1; a load either fails or returns exactly the saved tensors."""
    rng = random.Random(len(positions))
    missed: list[str] = []
    for position in positions:
        bit = rng.randrange(8)
        with flipped(saved.shard, position, bit):
            try:
                model, optim = load_into_fresh(ckpt)
                if not same_as_saved(saved, model, optim):
                    missed.append(f"byte {position} bit {bit}: load returned different tensors")
            except CheckpointError:
                pass  # an error is a fine answer; a wrong tensor is not
            result = verify(env)
            if result.exit_code != 1 or "shard header" not in result.stdout:
                missed.append(f"byte {position} bit {bit}: verify exited {result.exit_code}: {result.stdout[-300:]}")
    assert not missed, f"{len(missed)} of {len(positions)} header flips missed:\n" + "\n".join(missed)


def header_positions(saved: Saved, rng: random.Random, count: int) -> list[int]:
    edges = {0, 7, 8, saved.data_start - 1}
    return sorted(edges | set(rng.sample(range(saved.data_start), count)))


def embedded_env(saved: Saved) -> dict[str, str | None]:
    return {"CKPTSTORE_HOME": str(saved.home), "CKPTSTORE_URL": None, "CKPTSTORE_TOKEN": None}


def test_every_flipped_data_bit_fails_load_and_verify(saved: Saved) -> None:
    rng = random.Random(2024)
    edges = saved.tensor_edges()
    positions = edges + rng.sample(sorted(set(saved.owner) - set(edges)), RANDOM_DATA_FLIPS)
    assert len(positions) >= 100
    with client.Client(home=saved.home) as ckpt:
        assert verify(embedded_env(saved)).exit_code == 0
        check_data_flips(saved, ckpt, embedded_env(saved), positions)
        # Every flip was undone: the same store loads and verifies clean again.
        assert same_as_saved(saved, *load_into_fresh(ckpt))
    assert verify(embedded_env(saved)).exit_code == 0


def test_every_flipped_header_bit_fails_verify_and_never_loads_wrong_tensors(saved: Saved) -> None:
    positions = header_positions(saved, random.Random(2025), RANDOM_HEADER_FLIPS)
    with client.Client(home=saved.home) as ckpt:
        check_header_flips(saved, ckpt, embedded_env(saved), positions)
    assert verify(embedded_env(saved)).exit_code == 0


def test_flipped_bits_are_caught_over_http(saved: Saved, tmp_path: Path) -> None:
    rng = random.Random(2026)
    data = rng.sample(sorted(saved.owner), HTTP_DATA_FLIPS)
    header = header_positions(saved, rng, HTTP_HEADER_FLIPS)
    store = Store.open_home(saved.home)
    try:
        with running_server(create_app(store, Settings(home=saved.home))) as url, client.Client(url) as remote:
            env = {"CKPTSTORE_URL": url, "CKPTSTORE_HOME": str(tmp_path / "unused"), "CKPTSTORE_TOKEN": None}
            assert verify(env).exit_code == 0
            check_data_flips(saved, remote, env, data)
            check_header_flips(saved, remote, env, header)
            assert same_as_saved(saved, *load_into_fresh(remote))
    finally:
        store.close()
