"""A version spread over many shards loads over HTTP in a few batched requests, every byte verified."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import client
from ckptstore.client.loading.reader import BATCH_BYTES
from ckptstore.service.api import create_app
from ckptstore.service.errors import IntegrityError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.client.conftest import Backend
from tests.servers import running_server

SHARDS = 1000


@dataclass
class Served:
    url: str
    store: Store

    def requests(self, method: str, route: str) -> int:
        """How many requests of ``method route`` the server has answered, from its /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        pattern = re.compile(
            rf'ckptstore_requests_total{{method="{method}",route="{re.escape(route)}",status="\d+"}} (\d+)'
        )
        return sum(int(n) for n in pattern.findall(text))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = Store.open_home(tmp_path / "server")
    try:
        with running_server(create_app(store, Settings(home=tmp_path / "server"))) as url:
            yield Served(url, store)
    finally:
        store.close()


class Many(torch.nn.Module):
    """``count`` parameters of different small sizes, and one larger than a batch."""

    def __init__(self, count: int, big: bool = True) -> None:
        super().__init__()
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(1 + i % 37, 3)) for i in range(count))
        self.big = torch.nn.Parameter(torch.randn(BATCH_BYTES // 4 + 1000)) if big else None


def spread_over_shards(ckpt: client.Client, count: int, big: bool = True) -> Many:
    """A model saved so that every tensor is a shard of its own (shard_bytes=1)."""
    model = Many(count, big)
    ckpt.shard_bytes = 1
    result = ckpt.save("spread", model)
    assert result.tensors_total == count + (1 if big else 0)
    return model


def test_a_thousand_shards_load_in_a_few_requests(served: Served) -> None:
    with client.Client(served.url) as ckpt:
        saved = spread_over_shards(ckpt, SHARDS)
        assert len(list(served.store.blobs.list_ids())) == SHARDS + 1
        loaded = Many(SHARDS)
        assert not torch.equal(loaded.small[5], saved.small[5])
        ranged, batched = served.requests("GET", "/v1/shards/{shard_id}"), served.requests("POST", "/v1/shards/ranges")
        result = ckpt.load("spread", model=loaded)
    assert result.bytes_read == sum(p.numel() * 4 for p in saved.parameters())
    for mine, theirs in zip(loaded.parameters(), saved.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    # The big tensor alone is read by its own ranged GET; the thousand small ones in one batch, or
    # two where the big one's shard falls between theirs in storage order.
    assert 1 <= served.requests("POST", "/v1/shards/ranges") - batched <= 2
    assert served.requests("GET", "/v1/shards/{shard_id}") - ranged == 1


def test_a_corrupt_byte_in_one_of_many_shards_is_caught(served: Served) -> None:
    with client.Client(served.url) as ckpt:
        saved = spread_over_shards(ckpt, 200, big=False)
        digest = next(
            e.digest for e in ckpt.transport.manifest("spread").tensors if e.key == "model/small.123" and e.digest
        )
        location = served.store.locate([digest])[digest]
        path = served.store.blobs._path(location.shard_id)  # type: ignore[attr-defined]
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        data[location.offset + 3] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=r"model/small\.123"):
            ckpt.load("spread", model=Many(200, big=False))
        assert saved is not None


def test_a_spread_version_loads_on_every_backend(backend: Backend) -> None:
    saved = spread_over_shards(backend.client, 150, big=False)
    state = backend.client.load("spread").state_dict
    assert state is not None
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor), name
