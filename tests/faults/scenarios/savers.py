"""Saving clients for the fault scenarios, and the deterministic states they save.

A state is a pure function of (seed, run, step): a frozen part shared by every run of a seed
(stored once, then deduplicated), a part fresh at every step (``fresh_kib``), a bf16 tensor
and the step. So a version's listed step says exactly which bytes it must load as, and a
client's acknowledgement can be checked bit for bit long after the client is gone.

:class:`Savers` runs a few clients as threads, each saving its own run through a server (or
an embedded store), counting into a :class:`~tests.faults.scenarios.record.Tally`; over HTTP
every answer and network error the client's retry policy meets is counted too
(:class:`CountingPolicy`), retried ones included.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ckptstore.client.api import Client
from ckptstore.client.http.retry import NETWORK_ERRORS, Reply, RetryPolicy
from ckptstore.client.http.route import Route
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import StoreFindings, Tally
from tests.servers import running_server
from tests.stress.model import state_sha

R = TypeVar("R", bound=Reply)
FROZEN_KIB = 256
SHARD_BYTES = 256 << 10


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def make_state(seed: int, run: str, step: int, fresh_kib: int = 128) -> dict[str, torch.Tensor]:
    """The tensors ``run`` saves at ``step``."""
    return {
        "frozen": torch.randn(FROZEN_KIB * 256, generator=_generator(seed, "frozen")),
        "fresh": torch.randn(fresh_kib * 256, generator=_generator(seed, run, step, "fresh")),
        "half": torch.randn(64, 33, generator=_generator(seed, run, step, "half")).to(torch.bfloat16),
        "step": torch.tensor([step], dtype=torch.int64),
    }


def state_hash(seed: int, run: str, step: int, fresh_kib: int = 128) -> str:
    """The hash of :func:`make_state`'s tensors (see :func:`tests.stress.model.state_sha`)."""
    return state_sha(make_state(seed, run, step, fresh_kib))


@dataclass(frozen=True)
class CountingPolicy(RetryPolicy):
    """A retry policy that tells ``tally`` every answer status and network error it meets."""

    tally: Tally = field(default_factory=Tally, compare=False)

    def run(
        self,
        route: Route,
        method: str,
        path: str,
        send: Callable[[], R],
        doing: str = "",
        *,
        repeatable: bool | None = None,
    ) -> R:
        """:meth:`RetryPolicy.run`, counting each try's outcome."""

        def counted() -> R:
            try:
                reply = send()
            except NETWORK_ERRORS:
                self.tally.network_error()
                raise
            self.tally.answered(reply.status_code)
            return reply

        return super().run(route, method, path, counted, doing, repeatable=repeatable)


def counting_client(url: str, tally: Tally, retry_seconds: float) -> Client:
    """A client of the server at ``url`` whose requests are counted into ``tally``."""
    ckpt = Client(url, retry_seconds=retry_seconds, shard_bytes=SHARD_BYTES)
    transport = ckpt.transport
    assert isinstance(transport, HttpTransport)
    policy = CountingPolicy(transport.policy.seconds, transport.policy.retries, 0.1, tally=tally)
    transport.policy = transport.session.policy = policy
    return ckpt


@dataclass
class Savers:
    """``count`` client threads, each saving run ``saver-<i>`` step after step.

    Each saves ``saves`` versions, or, with ``until`` given, goes on until that event is set
    (and has saved at least ``saves``). Over HTTP (``url``) with a retry budget of
    ``retry_seconds``; else embedded in ``home``.
    """

    tally: Tally
    seed: int
    count: int
    saves: int
    url: str | None = None
    home: Path | None = None
    retry_seconds: float = 30.0
    fresh_kib: int = 128
    until: threading.Event | None = None
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def runs(self) -> list[str]:
        """The run each client saves."""
        return [f"saver-{index}" for index in range(self.count)]

    def start(self) -> Savers:
        """Start the clients."""
        for run in self.runs:
            thread = threading.Thread(target=self._save_all, args=(run,), name=f"scenario-{run}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def join(self) -> None:
        """Wait for every client to finish."""
        for thread in self.threads:
            thread.join(timeout=600)
            assert not thread.is_alive(), f"{thread.name} did not finish"

    def _client(self) -> Client:
        if self.url is not None:
            return counting_client(self.url, self.tally, self.retry_seconds)
        return Client(home=self.home, shard_bytes=SHARD_BYTES)

    def _save_all(self, run: str) -> None:
        try:
            ckpt = self._client()
        except Exception as exc:  # counted: a client that cannot even start is a failure to report
            self.tally.fail(exc)
            return
        with ckpt:
            step = 0
            while step < self.saves or (self.until is not None and not self.until.is_set()):
                self.save_one(ckpt, run, step)
                step += 1

    def save_one(self, ckpt: Client, run: str, step: int) -> Any:
        """Save ``run``'s state at ``step``, counting the outcome; the result, or None on failure."""
        tensors = make_state(self.seed, run, step, self.fresh_kib)
        self.tally.attempt()
        try:
            result = ckpt.save_state_dict(run, tensors, step=step)
        except Exception as exc:  # every failure is counted by class; unclean ones fail the scenario
            self.tally.fail(exc)
            return None
        self.tally.acknowledge(run, result.version, state_sha(tensors))
        return result


def saved_through_outages(
    store: Store, settings: Settings, tally: Tally, seed: int, savers: int, saves: int, outages: Callable[[], None]
) -> StoreFindings:
    """Serve ``store`` and save through it with ``savers`` clients while ``outages`` runs; then check
    what the store holds. The clients retry for up to a minute (an outage lasts seconds)."""
    stop = threading.Event()
    with running_server(create_app(store, settings)) as url:
        running = Savers(tally, seed, savers, saves, url=url, until=stop, retry_seconds=60).start()
        try:
            outages()
        finally:
            stop.set()
            running.join()
        with Client(url) as ckpt:
            return check_store(ckpt, running.runs, tally.acknowledged, lambda r, s: state_hash(seed, r, s))


class CountedApp:
    """ASGI middleware telling ``tally`` the status of every answer a server sends.

    For clients in other processes, whose retry policy cannot be reached: the server's side
    of the same answers.
    """

    def __init__(self, app: Any, tally: Tally) -> None:
        self.app, self.tally = app, tally

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.tally.answered(int(message["status"]))
            await send(message)

        await self.app(scope, receive, counted_send)
