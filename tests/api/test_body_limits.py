"""Per-route JSON body limits, enforced while reading, and bodies parsed off the event loop.

The server is ``ckptstore serve`` on PostgreSQL in a process of its own, so its memory can be
read from ``/proc``. While one client sends the largest body a route accepts (of unknown keys,
of a hundred thousand items, nested 100,000 deep, or a valid one), a second client asks for
``/healthz`` over and over: nine answers in ten must come within 50 ms and every one within
250 ms (the probe found 3 s for an 11 MiB body, 42 s for 110 MiB), and the server's peak
memory may grow by at most the multiple of the body docs/server.md states. Each route also refuses
a body one byte over its limit with a 413 naming the limit and the route, before the rest of
that body has been sent.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from ckptstore.service.api.app import create_app
from ckptstore.service.api.http.body_limits import DIGEST_LIST_BYTES, SMALL_BODY_BYTES
from ckptstore.service.api.schemas import MAX_DIGESTS
from ckptstore.service.db import Database, schema
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.api.kit import TOKEN_OF, TOKENS
from tests.api.served_process import ServedProcess, serve_process
from tests.backends import PostgresDatabases
from tests.servers import running_server

ROOT = Path(__file__).resolve().parents[2]
#: While the largest bodies are being handled, nine /healthz answers in ten must come within
#: HEALTHZ_P90 and every one within HEALTHZ_BUDGET: a stalled event loop (3 s for an 11 MiB body
#: before bodies were parsed off it) fails both, and one answer held up by a single long call
#: (a dict of a million keys growing, 30-40 ms on a slow host) fails neither.
HEALTHZ_P90 = 0.050
HEALTHZ_BUDGET = 0.250
PROBE_INTERVAL = 0.005
#: docs/server.md's bound on the extra memory of one request, as a multiple of its body.
DIGEST_LIST_MEMORY_MULTIPLE = 10
COMMIT_MEMORY_MULTIPLE = 30
COMMIT_LIMIT: int = Settings.model_fields["max_json_bytes"].default
#: A round of bodies is sent again, up to this many times, if a /healthz answer was slow: on a
#: shared machine another process can take the CPU for a moment. A server that stalls (3 s for
#: an 11 MiB body before) is slow in every round.
ROUNDS = 3
JSON = {"Content-Type": "application/json"}


# -- bodies -----------------------------------------------------------------------------------


def padded(body: bytes, size: int) -> bytes:
    """``body`` with spaces after it (still the same JSON) up to exactly ``size`` bytes."""
    assert len(body) <= size, (len(body), size)
    return body + b" " * (size - len(body))


def unknown_keys(size: int, value: bytes = b"0") -> bytes:
    """An object of distinct unknown keys, exactly ``size`` bytes long."""
    parts, used, number = [], 2, 0
    while True:
        part = b'"x%d":%s' % (number, value)
        if used + len(part) + 1 > size:
            break
        parts.append(part)
        used += len(part) + 1
        number += 1
    return padded(b"{" + b",".join(parts) + b"}", size)


def digest_list(count: int, size: int) -> bytes:
    """``{"digests": [...]}`` of ``count`` distinct digests, padded to ``size`` bytes."""
    digests = ",".join(f'"{number:064x}"' for number in range(count))
    return padded(f'{{"digests": [{digests}]}}'.encode(), size)


def manifest(size: int) -> bytes:
    """A commit of as many well-formed entries (of tensors the store lacks) as fit in ``size``."""
    entry = json.dumps(
        {
            "key": "model/layers.{n}.mlp.experts.7.down_proj.weight",
            "dtype": "BF16",
            "shape": [4096, 14336],
            "dtype_class": "floating",
            "digest": "{digest}",
            "placement": "target",
            "device_type": "cuda",
            "trainable": True,
        }
    )
    entries, used, number = [], 40, 0
    while True:
        text = entry.replace("{n}", str(number)).replace("{digest}", f"{number:064x}")
        if used + len(text) + 1 > size:
            break
        entries.append(text)
        used += len(text) + 1
        number += 1
    return padded(('{"manifest": {"tensors": [' + ",".join(entries) + "]}}").encode(), size)


# -- a client that measures /healthz while another sends ---------------------------------------


class HealthProbe:
    """Asks ``/healthz`` over one kept-alive connection, as fast as answers come, on a thread."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._answered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def _run(self) -> None:
        # One request every PROBE_INTERVAL at most: a sampling rate, so the probe measures the
        # server rather than competing with it for the CPU.
        while not self._stop.wait(PROBE_INTERVAL):
            started = time.perf_counter()
            self.connection.request("GET", "/healthz")
            response = self.connection.getresponse()
            response.read()
            self.latencies.append(time.perf_counter() - started)
            self._answered.set()
            if response.status != 200:
                self.failures.append(f"/healthz answered {response.status}")

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._answered.wait(timeout=30)  # a body refused at once still gets one answer measured
        self._stop.set()
        self._thread.join(timeout=60)
        self.connection.close()

    def within_budget(self) -> bool:
        """Nine answers in ten within HEALTHZ_P90, and every one within HEALTHZ_BUDGET."""
        ordered = sorted(self.latencies)
        return bool(ordered) and ordered[len(ordered) * 9 // 10] < HEALTHZ_P90 and ordered[-1] < HEALTHZ_BUDGET

    def summary(self) -> str:
        """The latencies, for a failure message."""
        ordered = sorted(self.latencies)
        return (
            f"{len(ordered)} answers; median {ordered[len(ordered) // 2] * 1000:.1f} ms, "
            f"p90 {ordered[len(ordered) * 9 // 10] * 1000:.1f} ms, "
            f"max {ordered[-1] * 1000:.1f} ms; over {HEALTHZ_BUDGET * 1000:.0f} ms: "
            f"{[round(x * 1000) for x in ordered if x > HEALTHZ_BUDGET]}"
        )


def post(url: str, path: str, body: bytes, token: str) -> tuple[int, dict[str, Any]]:
    """POST ``body`` over a new connection; the status and the JSON answer."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=300)
    try:
        connection.request("POST", path, body=body, headers={**JSON, "Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def send_while_probing(server: ServedProcess, path: str, token: str, bodies: dict[str, bytes]) -> dict[str, Any]:
    """Send each body in turn while probing /healthz; the answers by name, the probe and the memory growth."""
    answers = {}
    baseline = server.reset_peak()
    with HealthProbe(server.url) as probe:
        for name, body in bodies.items():
            answers[name] = post(server.url, path, body, token)
    run = {"answers": answers, "probe": probe, "grown": server.status_bytes("VmHWM") - baseline}
    print(probe.summary(), f"memory +{run['grown'] / 2**20:.0f} MiB")  # shown with -s
    return run


def rounds_until_fast(server: ServedProcess, path: str, token: str, bodies: dict[str, bytes]) -> list[dict[str, Any]]:
    """Rounds of :func:`send_while_probing`, until one has every /healthz answer within budget."""
    runs = []
    for _ in range(ROUNDS):
        runs.append(send_while_probing(server, path, token, bodies))
        if runs[-1]["probe"].within_budget():
            break
    return runs


def assert_fast(runs: list[dict[str, Any]]) -> None:
    """Some round kept every /healthz answer within budget, and no answer failed."""
    probes: list[HealthProbe] = [run["probe"] for run in runs]
    report = "; ".join(probe.summary() for probe in probes)
    assert not any(probe.failures for probe in probes), report
    assert all(probe.latencies for probe in probes), report
    assert any(probe.within_budget() for probe in probes), report


@pytest.fixture(scope="module")
def pg_url(postgres_databases: PostgresDatabases) -> str:
    """A PostgreSQL database of this module's own (its tests commit runs), at the newest schema."""
    url = postgres_databases.create()
    database = Database(url)
    try:
        schema.upgrade(database)
    finally:
        database.dispose()
    return url


@pytest.fixture
def serve_pg(pg_url: str, tmp_path: Path) -> Iterator[Callable[..., ServedProcess]]:
    """Start ``ckptstore serve`` on the PostgreSQL database with the test tokens (and more settings)."""
    with ExitStack() as stack:

        def start(**settings: str) -> ServedProcess:
            home = tmp_path / f"home-{len(settings)}-{time.monotonic_ns()}"
            return stack.enter_context(serve_process(home, database_url=pg_url, tokens=TOKENS, **settings))

        yield start


def warm_up(server: ServedProcess) -> None:
    """One request of each kind first, so what is measured is what the bodies cost."""
    assert post(server.url, "/v1/tensors/locate", b'{"digests": []}', TOKEN_OF["read"])[0] == 200
    assert post(server.url, "/v1/runs/warm/versions", b'{"manifest": {"tensors": []}}', TOKEN_OF["write"])[0] == 201


# -- the largest bodies, with /healthz and memory watched -------------------------------------


@pytest.mark.slow  # bodies at the size limit, with memory watched
def test_the_largest_digest_lists_leave_healthz_fast_and_memory_bounded(
    serve_pg: Callable[..., ServedProcess],
) -> None:
    server = serve_pg()
    warm_up(server)
    limit = DIGEST_LIST_BYTES
    bodies = {
        "unknown keys": unknown_keys(limit),
        "unknown keys with string values": unknown_keys(limit, b'""'),
        "valid, of the most digests": digest_list(MAX_DIGESTS, limit),
        "as many items as digests allowed, not strings": padded(
            b'{"digests": [' + b",".join([b"0"] * (MAX_DIGESTS + 60)) + b"]}", limit
        ),
        "nested 100,000 deep": b'{"digests": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "one byte over the limit": unknown_keys(limit + 1),
    }
    runs = rounds_until_fast(server, "/v1/tensors/locate", TOKEN_OF["read"], bodies)
    answers = runs[0]["answers"]
    assert answers["unknown keys"][0] == 400 and "object members" in answers["unknown keys"][1]["message"]
    assert answers["unknown keys with string values"][0] == 400
    assert answers["valid, of the most digests"][0] == 404  # parsed, validated, looked up: none stored
    assert answers["as many items as digests allowed, not strings"][0] == 422
    assert answers["nested 100,000 deep"][0] == 400 and "deeper" in answers["nested 100,000 deep"][1]["message"]
    status, over = answers["one byte over the limit"]
    assert status == 413 and over["code"] == "payload_too_large"
    assert "POST /v1/tensors/locate" in over["message"] and str(limit) in over["message"]
    for name, (_, answer) in answers.items():
        assert set(answer) >= {"code", "message"}, (name, answer)
    assert_fast(runs)
    grown = max(run["grown"] for run in runs)
    assert grown <= DIGEST_LIST_MEMORY_MULTIPLE * limit, f"{grown / 2**20:.1f} MiB"


def state_body(extra: bytes) -> bytes:
    """A commit of no tensors whose ``extra`` state is ``extra``, padded to the commit limit."""
    return padded(b'{"manifest": {"tensors": [], "state": {"extra": ' + extra + b"}}}", COMMIT_LIMIT)


def repeated(item: bytes, size: int) -> bytes:
    """A JSON array of ``item`` as many times as fit in ``size`` bytes."""
    return b"[" + b",".join([item] * (size // (len(item) + 1))) + b"]"


#: The largest commits, each with the status it must get; the state trees are written out in slices.
COMMITS: dict[str, tuple[Callable[[], bytes], int]] = {
    "an extra state of millions of numbers": (lambda: state_body(repeated(b"7", COMMIT_LIMIT - 64)), 201),
    "a manifest of the most tensors (the store lacks them)": (lambda: manifest(COMMIT_LIMIT), 409),
    "an extra state of a million keys": (lambda: state_body(unknown_keys(COMMIT_LIMIT - 64, b'""')), 201),
    "an extra state of nothing but empty arrays": (lambda: state_body(repeated(b"[]", COMMIT_LIMIT - 64)), 400),
    "one byte over the limit": (lambda: padded(b'{"manifest": {"tensors": []}}', COMMIT_LIMIT + 1), 413),
}


@pytest.mark.slow  # bodies at the size limit, with memory watched
@pytest.mark.parametrize("shape", list(COMMITS))
def test_the_largest_commits_leave_healthz_fast_and_memory_bounded(
    serve_pg: Callable[..., ServedProcess], shape: str
) -> None:
    """One body per server, so the first round's memory growth is what that body costs."""
    make, expected = COMMITS[shape]
    body = make()
    server = serve_pg()  # the default limit
    warm_up(server)
    runs = rounds_until_fast(server, "/v1/runs/big/versions", TOKEN_OF["write"], {shape: body})
    status, answer = runs[0]["answers"][shape]
    assert status == expected, answer
    if status == 409:
        assert answer["code"] == "missing_tensors"
    if status == 400:
        assert "arrays and objects" in answer["message"], answer
    if status == 413:
        assert "POST /v1/runs/{run_id}/versions" in answer["message"] and str(COMMIT_LIMIT) in answer["message"]
        assert "CKPTSTORE_MAX_JSON_BYTES" in answer["message"], answer
    assert_fast(runs)
    assert runs[0]["grown"] <= COMMIT_MEMORY_MULTIPLE * len(body), f"{runs[0]['grown'] / 2**20:.1f} MiB"


# -- every route's own limit, on a server in this process ------------------------------------


@pytest.fixture
def pg_server(pg_url: str, tmp_path: Path) -> Iterator[str]:
    """The app on PostgreSQL, served by uvicorn as ``ckptstore serve`` sets it up; its URL."""
    settings = Settings(home=tmp_path / "home", database_url=pg_url, tokens=TOKENS)
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings), settings) as url:
            yield url
    finally:
        store.close()


ROUTES = {
    "POST /v1/tensors/missing": ("write", DIGEST_LIST_BYTES, None),
    "POST /v1/tensors/locate": ("read", DIGEST_LIST_BYTES, None),
    "POST /v1/runs/{run_id}/versions": ("write", COMMIT_LIMIT, "CKPTSTORE_MAX_JSON_BYTES"),
    "PUT /v1/runs/{run_id}/tags/{name}": ("write", SMALL_BODY_BYTES, None),
    "PUT /v1/runs/{run_id}/retention": ("admin", SMALL_BODY_BYTES, None),
    "POST /v1/gc": ("admin", SMALL_BODY_BYTES, None),
}


def concrete(route: str) -> tuple[str, str]:
    method, path = route.split(" ")
    return method, path.replace("{run_id}", "run-a").replace("{name}", "best")


def raw_exchange(url: str, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request head and body parts, then read until the server has answered and closed."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer:
                head_part, _, rest = answer.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: (\d+)", head_part)
                if length and len(rest) >= int(length.group(1)):
                    break
    return answer


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_body_one_byte_over_a_routes_limit_is_413_naming_it(pg_server: str, route: str) -> None:
    scope, limit, setting = ROUTES[route]
    method, path = concrete(route)
    auth = f"Authorization: Bearer {TOKEN_OF[scope]}\r\nContent-Type: application/json\r\n"

    declared = raw_exchange(
        pg_server, f"{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Content-Length: {limit + 1}\r\n\r\n".encode(), []
    )
    # Chunked, without a length, and the body never finished: the 413 comes while it is still open.
    chunk = b"x" * (limit + 1)
    streamed = raw_exchange(
        pg_server,
        f"{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}Transfer-Encoding: chunked\r\n\r\n".encode(),
        [b"%x\r\n" % len(chunk), chunk, b"\r\n"],
    )
    for answer in (declared, streamed):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:300]
        error = json.loads(body)
        assert error["code"] == "payload_too_large"
        assert route in error["message"] and str(limit) in error["message"], error
        assert (setting in error["message"]) if setting else ("CKPTSTORE_" not in error["message"]), error


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_body_of_exactly_a_routes_limit_is_read(pg_server: str, route: str) -> None:
    scope, limit, _ = ROUTES[route]
    method, path = concrete(route)
    small = {"POST /v1/gc": b'{"dry_run": true}', "PUT /v1/runs/{run_id}/tags/{name}": b'{"version": 1}'}
    body = padded(small.get(route, b'{"keep_last": 2}' if "retention" in route else b'{"digests": []}'), limit)
    if "versions" in route:
        body = padded(b'{"manifest": {"tensors": []}}', limit)
    answer = raw_exchange(
        pg_server,
        f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN_OF[scope]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode(),
        [body],
    )
    assert not answer.startswith(b"HTTP/1.1 413") and not answer.startswith(b"HTTP/1.1 5"), answer[:300]


def test_a_token_is_checked_before_a_body_is_read(pg_server: str) -> None:
    """No token: 401 at once, even for a body far over the limit that never arrives."""
    answer = raw_exchange(
        pg_server,
        f"POST /v1/tensors/locate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {DIGEST_LIST_BYTES * 4}\r\n\r\n".encode(),
        [],
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]


# -- docs/server.md states the same limits ------------------------------------------------------


def limits_table() -> dict[str, str]:
    """docs/server.md's body limits table: route -> limit cell."""
    page = (ROOT / "docs" / "server.md").read_text()
    section = page.split("\n## Limits and timeouts\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].strip("`").split(" ")[0].isupper():
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_server_page_lists_every_routes_body_limit() -> None:
    def shown(size: int) -> str:
        return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"

    table = limits_table()
    defaults = {**{route: shown(limit) for route, (_, limit, _) in ROUTES.items()}}
    defaults["POST /v1/runs/{run_id}/versions"] = shown(Settings.model_fields["max_json_bytes"].default)
    for route, size in defaults.items():
        assert route in table, (route, sorted(table))
        assert size in table[route], (route, table[route])
