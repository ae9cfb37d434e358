"""Shard uploads straight to S3: presigned URLs, verification before anything references the bytes.

Against a real uvicorn server whose blobs live in a real (moto) S3 bucket. The clients' upload
URLs are signed for a gate in front of moto (:mod:`tests.s3_gate`) that refuses expired URLs as
S3 does and counts what it saw; the server's own S3 requests go to moto directly. Saves and
loads go through the torch client; hostile uploads are sent by hand with httpx.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptstore.client.api import Client
from ckptstore.client.http import direct_uploads
from ckptstore.client.http.direct_uploads import DirectUploads, cut, shown, uploads_for
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.blobs.s3_staging import S3Staging
from ckptstore.service.db import Database, schema
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.intake.receiver import ShardReceiver
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, WRITE_TOKEN, bearer, build_shard, tensor
from tests.backends import unfinished_uploads
from tests.s3_gate import GateLog, s3_gate
from tests.servers import running_server
from tests.service.shardkit import RawTensor

PART = 5 << 20  # the store's part size: shards above it go up in parts
ROOT = Path(__file__).resolve().parents[2]


class SignedElsewhere(S3BlobStore):
    """An S3 store whose upload URLs are signed for another address (the gate, or nowhere)."""

    signer: Any = None

    def staging(self) -> S3Staging:
        area = super().staging()
        if self.signer is not None:
            area.signer = self.signer
        return area


@dataclass
class Rig:
    """A served store on S3 blobs, the bucket, the gate's log and the shards sent through the server."""

    url: str
    store: Store
    s3: Any
    bucket: str
    gate: GateLog
    proxied: list[str] = field(default_factory=list)

    def staged(self) -> list[str]:
        """Staged objects and unfinished staged uploads left in the bucket."""
        keys = [o["Key"] for o in self.s3.list_objects_v2(Bucket=self.bucket).get("Contents", [])]
        uploads = list(unfinished_uploads(self.s3, self.bucket).values())
        return [key for key in keys + uploads if "/staging/" in key]

    def blobs(self) -> list[str]:
        """The blob ids stored in the bucket."""
        return sorted(self.store.blobs.list_ids())


@pytest.fixture(scope="module")
def boto_session() -> Any:
    import boto3

    return boto3.session.Session()


@pytest.fixture
def make_rig(s3_endpoint: str, tmp_path: Path, boto_session: Any) -> Iterator[Callable[..., Rig]]:
    """Builds served stores on fresh buckets: ``signer`` "gate" (default), "moto" or "dead"."""
    with ExitStack() as stack:

        def make(*, signer: str = "gate", **settings: Any) -> Rig:
            s3 = make_client(s3_endpoint, session=boto_session)
            bucket = f"direct-{uuid.uuid4().hex[:12]}"
            s3.create_bucket(Bucket=bucket)
            gate_url, gate = stack.enter_context(s3_gate(s3_endpoint))
            home = tmp_path / bucket
            database = Database.sqlite_file(home / "metadata.db")
            schema.upgrade(database)
            blobs = SignedElsewhere(bucket, "shards", client=s3, part_bytes=PART)
            if signer == "gate":
                blobs.signer = make_client(gate_url, session=boto_session)
            elif signer == "dead":
                blobs.signer = make_client("http://127.0.0.1:9", session=boto_session)  # nothing listens there
            store = Store(database, blobs, home / "staging")
            stack.callback(store.close)
            rig = Rig("", store, s3, bucket, gate)
            ingest = store.ingest_received

            def proxied(receiver: ShardReceiver, **kwargs: Any) -> ShardReceipt:
                rig.proxied.append(str(receiver.expected_id))
                return ingest(receiver, **kwargs)

            store.ingest_received = proxied  # type: ignore[method-assign]
            served = Settings(home=home, tokens=TOKENS, **settings)
            rig.url = stack.enter_context(running_server(create_app(store, served), served))  # with its access log
            return rig

        yield make


def model(seed: int, *widths: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for width in widths))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def save_and_load(url: str, widths: tuple[int, ...], shard_bytes: int = 64 << 20) -> DirectUploads:
    """Save a model over HTTP, load it into another, check it is bitwise the saved one; the client's uploads."""
    saved, target = model(1, *widths), model(2, *widths)
    assert not same(saved, target)
    with Client(url, token=WRITE_TOKEN, shard_bytes=shard_bytes) as client:
        client.save("run", saved)
        client.load("run", model=target)
        assert isinstance(client.transport, HttpTransport)
        uploads = uploads_for(client.transport.session)
    assert same(saved, target)
    return uploads


# -- the direct path ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("widths", "parts"),
    [((64, 32), 1), ((1400,), 2)],  # one small shard: a single PUT; 7.8 MiB: two parts of 5 MiB
    ids=["single-put", "multipart"],
)
def test_a_save_goes_to_s3_directly_and_loads_bitwise(
    make_rig: Callable[..., Rig], widths: tuple[int, ...], parts: int
) -> None:
    rig = make_rig()
    uploads = save_and_load(rig.url, widths)
    assert uploads.offered and rig.proxied == []  # no shard byte went through the server
    assert rig.gate.puts == parts and rig.gate.expired == 0
    assert rig.staged() == [] and len(rig.blobs()) == 1


def test_shards_of_many_sizes_in_one_save(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    save_and_load(rig.url, (1400, 16, 1500), shard_bytes=8 << 20)
    assert rig.proxied == [] and rig.staged() == [] and len(rig.blobs()) >= 2


def test_a_url_used_after_it_expired_is_refused_and_the_client_asks_again(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(upload_url_seconds=1)
    put = DirectUploads._put
    late = [True]

    def slow_first(self: DirectUploads, url: str, pieces: list[memoryview]) -> None:
        if late.pop() if late else False:
            time.sleep(2.2)  # past the URL's one second
        put(self, url, pieces)

    monkeypatch.setattr(DirectUploads, "_put", slow_first)
    uploads = save_and_load(rig.url, (64,))
    assert rig.gate.expired == 1 and rig.gate.puts == 2  # refused once, then sent on a fresh URL
    assert uploads.offered and rig.proxied == [] and rig.staged() == []


# -- verification ----------------------------------------------------------------------------------


def grant(url: str, shard_id: str, size: int, scope: str = "write") -> httpx.Response:
    return httpx.post(f"{url}/v1/shards/{shard_id}/uploads", json={"size": size}, headers=bearer(scope), timeout=30)


def send(url: str, shard_id: str, data: bytes) -> tuple[str, httpx.Response]:
    """Upload ``data`` as shard ``shard_id`` by hand: the grant, the PUTs, then the completion."""
    answer = grant(url, shard_id, len(data))
    assert answer.status_code == 201, answer.text
    body = answer.json()
    step = body["part_bytes"]
    for number, target in enumerate(body["urls"]):
        assert httpx.put(target, content=data[number * step : (number + 1) * step], timeout=30).status_code == 200
    done = httpx.post(
        f"{url}/v1/shards/{shard_id}/uploads/{body['upload']}", json={"size": len(data)}, headers=bearer("write")
    )
    return body["upload"], done


BIG = RawTensor("U8", (PART + 12345,), os.urandom(PART + 12345))


@pytest.mark.parametrize("big", [False, True], ids=["single-put", "multipart"])
def test_bytes_that_do_not_match_their_digests_are_never_stored_nor_offered(
    make_rig: Callable[..., Rig], big: bool
) -> None:
    rig = make_rig()
    shard = build_shard(tensor(1), BIG if big else tensor(2, "F32", (64, 64)))
    bad = bytearray(shard.data)
    bad[-100] ^= 0x01  # one bit of the last tensor
    _token, done = send(rig.url, shard.shard_id, bytes(bad))

    assert done.status_code == 400 and done.json()["code"] == "integrity", done.text
    assert shard.digests[1][:16] in done.json()["message"]
    assert rig.staged() == [] and rig.blobs() == []
    # Not offered for deduplication: a save of the same tensors must send them again.
    transport = HttpTransport(rig.url, WRITE_TOKEN)
    try:
        assert transport.missing(shard.digests) == shard.digests
        header, pieces = shard.data[: shard.header_length], [memoryview(t.data) for t in shard.tensors]
        receipt = transport.put_shard(header, pieces)
    finally:
        transport.close()
    assert receipt.created and rig.blobs() == [shard.shard_id] and rig.proxied == []


#: When the attacker re-PUTs other bytes to its still-valid URL: the server's S3 call it comes
#: before, and which such call (0: the first).
SWAP_AT = {
    "before-the-seal": ("CopyObject", 0),
    "during-the-check": ("GetObject", 0),
    "before-the-publish": ("CopyObject", 1),
}


@pytest.mark.parametrize("moment", sorted(SWAP_AT))
def test_bytes_swapped_while_the_server_completes_are_never_referenced(
    make_rig: Callable[..., Rig], moment: str
) -> None:
    """A write token stages a public tensor, then swaps other bytes of the same length in through its
    URL at each step of the completion: the swapped bytes are refused or never read, and the next user
    saving that tensor (which dedup then skips sending) loads it bit for bit."""
    rig = make_rig()
    base = model(11, 96)  # the public base weights both users save
    weight = base[0].weight.detach()
    shard = build_shard(RawTensor("F32", tuple(weight.shape), weight.numpy().tobytes()))
    swapped = bytearray(shard.data)
    swapped[-1] ^= 0xFF  # same length, same header: only the tensor's bytes differ
    answer = grant(rig.url, shard.shard_id, len(shard.data)).json()
    (url,) = answer["urls"]
    assert httpx.put(url, content=shard.data, timeout=30).status_code == 200
    operation, skip = SWAP_AT[moment]
    calls: list[int] = []

    def swap(**_: Any) -> None:
        calls.append(len(calls))
        if len(calls) == skip + 1:
            calls.append(httpx.put(url, content=bytes(swapped), timeout=30).status_code)

    event = f"before-call.s3.{operation}"
    rig.s3.meta.events.register(event, swap)
    try:
        done = httpx.post(
            f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{answer['upload']}",
            json={"size": len(shard.data)},
            headers=bearer("write"),
            timeout=60,
        )
    finally:
        rig.s3.meta.events.unregister(event, swap)
    assert 200 in calls, f"the swap was not made at {moment}: {calls}"  # the URL still took the bytes
    if done.status_code == 201:
        stored = bytearray(len(shard.data))
        rig.store.blobs.read_into(shard.shard_id, 0, memoryview(stored))
        assert bytes(stored) == shard.data, "the bucket holds bytes the server never checked"
    else:
        assert done.status_code == 400 and done.json()["code"] == "integrity", done.text
        assert rig.blobs() == []
    assert rig.staged() == []
    victim, target = model(11, 96), model(12, 96)
    with Client(rig.url, token=WRITE_TOKEN) as client:
        client.save("victim", victim)
        client.load("victim", model=target)
    assert same(victim, target)


def test_a_sealed_copy_a_crash_left_is_swept_with_the_staged_uploads(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(tensor(9))
    staged = grant(rig.url, shard.shard_id, len(shard.data)).json()
    assert httpx.put(staged["urls"][0], content=shard.data, timeout=30).status_code == 200
    area = rig.store.blobs.staging()
    seal = area.seal(shard.shard_id, staged["upload"], len(shard.data))  # a server killed before it unsealed
    assert len(rig.staged()) == 2 and any(key.endswith(f".{seal}") for key in rig.staged())
    swept = rig.store.gc(grace_seconds=0, orphans=True)
    assert swept.stale_uploads == 2 and rig.staged() == [] and rig.blobs() == []


def test_a_shard_uploaded_under_another_id_is_refused(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    mine, other = build_shard(tensor(3)), build_shard(tensor(4))
    _token, done = send(rig.url, other.shard_id, mine.data)
    assert done.status_code == 400 and done.json()["code"] == "integrity"
    assert other.shard_id in done.json()["message"] and rig.staged() == [] and rig.blobs() == []


def test_a_multipart_upload_missing_a_part_is_refused_naming_it(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(BIG)
    answer = grant(rig.url, shard.shard_id, len(shard.data)).json()
    assert len(answer["urls"]) == 2 and answer["part_bytes"] == PART
    assert httpx.put(answer["urls"][0], content=shard.data[:PART], timeout=30).status_code == 200
    done = httpx.post(
        f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{answer['upload']}",
        json={"size": len(shard.data)},
        headers=bearer("write"),
    )
    assert done.status_code == 400 and "missing parts 2" in done.json()["message"], done.text
    assert rig.staged() == [] and rig.blobs() == []


def test_completing_twice_answers_the_stored_shard(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(tensor(5))
    token, done = send(rig.url, shard.shard_id, shard.data)
    assert done.status_code == 201 and done.json()["created"] is True
    again = httpx.post(
        f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{token}", json={"size": len(shard.data)}, headers=bearer("write")
    )
    assert again.status_code == 200 and again.json() == {**done.json(), "created": False}


def test_nothing_uploaded_is_a_404(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(tensor(6))
    token = grant(rig.url, shard.shard_id, len(shard.data)).json()["upload"]
    done = httpx.post(
        f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{token}", json={"size": len(shard.data)}, headers=bearer("write")
    )
    assert done.status_code == 404 and "ask for a new upload" in done.json()["message"]


# -- scopes and bounds ---------------------------------------------------------------------------


def test_a_read_token_cannot_obtain_an_upload_url(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(tensor(7))
    refused = grant(rig.url, shard.shard_id, len(shard.data), scope="read")
    assert refused.status_code == 403 and refused.headers["x-error-code"] == "forbidden"
    assert "X-Amz" not in refused.text
    anonymous = httpx.post(f"{rig.url}/v1/shards/{shard.shard_id}/uploads", json={"size": 100})
    assert anonymous.status_code == 401
    path = f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{'0' * 32}"
    assert httpx.post(path, json={"size": 100}, headers=bearer("read")).status_code == 403
    assert httpx.delete(path, headers=bearer("read")).status_code == 403
    assert rig.gate.requests == []


@pytest.mark.parametrize(
    ("size", "status"),
    [(0, 422), (7, 400), (1 << 20, 201), ((1 << 20) + 1, 413), (2**63, 422), ("12", 422)],
)
def test_an_upload_is_bounded_as_a_proxied_one_is(make_rig: Callable[..., Rig], size: Any, status: int) -> None:
    rig = make_rig(max_shard_bytes=1 << 20)
    answer = httpx.post(f"{rig.url}/v1/shards/{'a' * 64}/uploads", json={"size": size}, headers=bearer("write"))
    assert answer.status_code == status, answer.text


def test_a_grant_names_its_lifetime_and_is_not_cached(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(upload_url_seconds=120)
    answer = grant(rig.url, "b" * 64, 3 * PART)
    body = answer.json()
    assert answer.headers["cache-control"] == "no-store" and body["expires_in"] == 120
    assert len(body["urls"]) == 3 and all("X-Amz-Expires=120" in url for url in body["urls"])
    assert all("/shards/staging/" + "b" * 64 + "." + body["upload"] in url for url in body["urls"])
    # Each URL signs its body's length, so S3 refuses a part of any other size.
    assert all("X-Amz-SignedHeaders=content-length%3Bhost" in url for url in body["urls"])
    single = grant(rig.url, "c" * 64, PART // 2).json()["urls"]
    assert len(single) == 1 and "X-Amz-SignedHeaders=content-length%3Bhost" in single[0]


# -- leftovers and garbage collection -----------------------------------------------------------


def test_gc_removes_staged_uploads_past_its_grace_period(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    small, big = build_shard(tensor(8)), build_shard(BIG)
    staged = grant(rig.url, small.shard_id, len(small.data)).json()  # sent, never completed
    assert httpx.put(staged["urls"][0], content=small.data, timeout=30).status_code == 200
    partial = grant(rig.url, big.shard_id, len(big.data)).json()  # one part of two, never completed
    assert httpx.put(partial["urls"][0], content=big.data[:PART], timeout=30).status_code == 200
    assert len(rig.staged()) == 2

    kept = rig.store.gc(orphans=True)  # the default grace of an hour spares them
    assert (kept.stale_uploads, kept.uploads_aborted) == (0, 0) and len(rig.staged()) == 2
    dry = rig.store.gc(grace_seconds=0, orphans=True, dry_run=True)
    assert (dry.stale_uploads, dry.uploads_aborted) == (2, 0) and dry.stale_upload_bytes == len(small.data) + PART
    swept = rig.store.gc(grace_seconds=0, orphans=True)
    assert (swept.stale_uploads, swept.uploads_aborted) == (2, 2)
    assert rig.staged() == [] and rig.blobs() == []


def test_an_abandoned_upload_is_deleted_when_the_client_gives_up(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    shard = build_shard(BIG)
    answer = grant(rig.url, shard.shard_id, len(shard.data)).json()
    assert httpx.put(answer["urls"][0], content=shard.data[:PART], timeout=30).status_code == 200
    path = f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{answer['upload']}"
    assert httpx.delete(path, headers=bearer("write")).status_code == 204
    assert httpx.delete(path, headers=bearer("write")).status_code == 204
    assert rig.staged() == []


VICTIM = textwrap.dedent(
    """
    import sys, torch
    from ckptstore.client.api import Client
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1400, 1400) for _ in range(4)))
    with Client(sys.argv[1], token=sys.argv[2], shard_bytes=16 << 20) as client:
        print("saving", flush=True)
        client.save("killed", model)
    print("saved", flush=True)
    """
)


@pytest.mark.slow  # a subprocess importing torch
def test_a_client_killed_mid_upload_leaves_no_version_and_gc_leaves_nothing(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.gate.put_delay = 0.5  # each part is held, so the kill lands while parts are on their way
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, rig.url, WRITE_TOKEN],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 120
        while rig.gate.puts < 2:
            assert victim.poll() is None and time.monotonic() < deadline, "the save ended before it uploaded"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert rig.store.runs() == [] and rig.blobs() == []
    time.sleep(1.0)  # let the parts the gate still held land
    assert rig.staged() != []
    report = rig.store.gc(grace_seconds=0, orphans=True)
    assert report.uploads_aborted >= 1 and rig.staged() == [] and rig.blobs() == []


# -- fallbacks ----------------------------------------------------------------------------------


def test_a_server_on_local_disk_takes_uploads_through_itself(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    settings = Settings(home=tmp_path / "home", tokens=TOKENS)
    try:
        with running_server(create_app(store, settings)) as url:
            shard = build_shard(tensor(9))
            refused = grant(url, shard.shard_id, len(shard.data))
            assert refused.status_code == 409 and "PUT /v1/shards/" in refused.json()["message"]
            uploads = save_and_load(url, (64, 32))
    finally:
        store.close()
    # The server said it takes no direct uploads: the save sent its new tensors to it unhashed,
    # never asking for URLs.
    assert uploads.offered and len(list(store.blobs.list_ids())) == 1


def test_a_hashed_shard_for_a_server_on_local_disk_asks_for_urls_once_then_goes_through_it(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    settings = Settings(home=tmp_path / "home", tokens=TOKENS)
    saved = model(1, 64, 32)
    try:
        with running_server(create_app(store, settings)) as url, Client(url, token=WRITE_TOKEN) as client:
            assert isinstance(client.transport, HttpTransport)
            client.transport.takes_unhashed = False  # as for a server that predates unhashed uploads
            client.save("run", saved)
            client.save("run", model(3, 64, 32))
            uploads = uploads_for(client.transport.session)
    finally:
        store.close()
    assert not uploads.offered  # asked once, then every shard went through the server
    assert len(list(store.blobs.list_ids())) == 2


def test_upload_urls_turned_off_send_everything_through_the_server(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(upload_url_seconds=0)
    uploads = save_and_load(rig.url, (64, 32))
    # The server says it takes no direct uploads: the new tensors went to it unhashed, no URL asked.
    assert uploads.offered and rig.proxied == [] and rig.gate.requests == [] and len(rig.blobs()) == 1


def test_an_unreachable_s3_sends_the_shard_through_the_server(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(signer="dead")
    with caplog.at_level(logging.WARNING, logger=direct_uploads.__name__):
        uploads = save_and_load(rig.url, (64, 32))
    assert not uploads.offered and len(rig.proxied) == 1 and rig.staged() == []
    assert "cannot reach S3" in caplog.text and "X-Amz" not in caplog.text


# -- secrets -------------------------------------------------------------------------------------


def test_no_log_line_holds_a_signed_url(make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(upload_url_seconds=1)
    with caplog.at_level(logging.DEBUG):
        shard = build_shard(tensor(10))
        answer = grant(rig.url, shard.shard_id, len(shard.data)).json()
        time.sleep(2.2)
        assert httpx.put(answer["urls"][0], content=shard.data, timeout=30).status_code == 403  # expired
        httpx.post(f"{rig.url}/v1/shards/{shard.shard_id}/uploads/{answer['upload']}", json={"size": 1},
                   headers=bearer("write"))  # fmt: skip
        save_and_load(rig.url, (64,))
    ours = [r for r in caplog.records if r.name.startswith(("uvicorn", "ckptstore", "client", "service"))]
    assert any("/uploads" in r.getMessage() for r in ours)  # the access log saw the requests
    assert not any("X-Amz" in r.getMessage() or "Signature" in r.getMessage() for r in ours)


def test_a_url_in_a_message_shows_no_signature() -> None:
    url = (
        "https://bucket.s3.amazonaws.com/shards/staging/ab.cd?partNumber=1&uploadId=x&X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIA%2F20260101&X-Amz-Signature=0123456789abcdef&X-Amz-Security-Token=secret"
    )
    assert shown(url) == "https://bucket.s3.amazonaws.com/shards/staging/ab.cd?…"


def test_bytes_are_cut_into_parts_without_copies() -> None:
    data = bytes(range(256)) * 40
    views = [memoryview(data)[:1000], memoryview(data)[1000:1003], memoryview(data)[1003:]]
    parts = cut(views, 999)
    assert [sum(p.nbytes for p in part) for part in parts] == [999] * 10 + [250]
    assert b"".join(bytes(p) for part in parts for p in part) == data
    assert all(p.obj is data for part in parts for p in part)
