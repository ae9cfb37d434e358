"""The byte budget of streamed answers and how a stream is opened (service.api.http.streaming), on an
event loop of the test's own: who gets bytes in which order, and that every byte comes back."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from ckptstore.service.api.http.streaming import PIECE_BYTES, ByteBudget, Streamer
from ckptstore.service.errors import ServerBusyError


def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coroutine)


async def settle() -> None:
    """Let every task that can run, run (a few turns of the loop)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_bytes_are_handed_out_first_come_first_served() -> None:
    async def scenario() -> list[str]:
        budget = ByteBudget(100)
        assert await budget.take(80) == 80 and budget.held == 80
        served: list[str] = []

        async def wait(name: str, nbytes: int) -> None:
            await budget.take(nbytes)
            served.append(name)

        tasks = [asyncio.create_task(wait("big", 60)), asyncio.create_task(wait("small", 10))]
        await settle()
        assert served == []  # 20 are free: "small" fits, but "big" asked first
        budget.give(50)  # 70 free: both fit, served in the order they asked
        await settle()
        assert served == ["big", "small"] and budget.free == 0
        await asyncio.gather(*tasks)
        return served

    run(scenario())


def test_a_request_larger_than_the_budget_waits_for_all_of_it() -> None:
    async def scenario() -> None:
        budget = ByteBudget(10)
        assert await budget.take(1000) == 10 and budget.free == 0
        budget.give(10)

    run(scenario())


def test_a_cancelled_wait_takes_nothing_and_lets_the_next_one_in() -> None:
    async def scenario() -> None:
        budget = ByteBudget(100)
        await budget.take(90)
        first = asyncio.create_task(budget.take(50))
        second = asyncio.create_task(budget.take(10))
        await settle()
        assert not first.done() and not second.done()
        first.cancel()
        await settle()
        assert first.cancelled() and second.done() and budget.free == 0
        budget.give(100)
        assert budget.free == budget.total

    run(scenario())


def test_bytes_given_back_while_a_cancelled_wait_has_not_run_yet_are_not_lost() -> None:
    async def scenario() -> None:
        budget = ByteBudget(100)
        await budget.take(100)
        cancelled = asyncio.create_task(budget.take(60))
        behind = asyncio.create_task(budget.take(30))
        await settle()
        cancelled.cancel()  # its future is cancelled now, the task learns it on its next turn
        budget.give(100)  # so this turn skips it and serves the one behind
        await settle()
        assert cancelled.cancelled() and await behind == 30 and budget.free == 70

    run(scenario())


def test_bytes_granted_to_a_wait_cancelled_meanwhile_go_back() -> None:
    async def scenario() -> None:
        budget = ByteBudget(100)
        await budget.take(100)
        waiter = asyncio.create_task(budget.take(30))
        await settle()
        budget.give(30)  # granted: the waiter's future is resolved, the task has not run yet
        waiter.cancel()
        await settle()
        assert waiter.cancelled() and budget.free == 30

    run(scenario())


def test_the_budget_must_hold_a_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        ByteBudget(0)


class Source:
    """Pieces of a blob, with a record of how far they were read and whether they were closed."""

    def __init__(self, pieces: list[bytes], fail: Exception | None = None) -> None:
        self.pieces, self.fail, self.closed, self.read = pieces, fail, False, 0

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self.fail is not None:
            raise self.fail
        if self.read == len(self.pieces):
            raise StopIteration
        self.read += 1
        return self.pieces[self.read - 1]

    def close(self) -> None:
        self.closed = True


def test_opening_a_stream_reads_its_first_piece_and_holds_its_size() -> None:
    async def scenario() -> None:
        streamer = Streamer(4 * PIECE_BYTES, write_timeout=5)
        source = Source([b"a" * 1000, b"b" * 10])
        stream = await streamer.open(source, 206, {"Content-Length": "1010"})
        assert (stream.status_code, source.read, streamer.budget.held) == (206, 1, 1000)
        assert stream.headers["content-type"] == "application/octet-stream"

    run(scenario())


def test_a_first_piece_that_cannot_be_read_gives_its_bytes_back_and_closes_the_source() -> None:
    async def scenario() -> None:
        streamer = Streamer(4 * PIECE_BYTES, write_timeout=5)
        source = Source([], fail=OSError("disk gone"))
        with pytest.raises(OSError, match="disk gone"):
            await streamer.open(source)
        assert source.closed and streamer.budget.held == 0

    run(scenario())


def test_a_first_piece_without_room_within_the_write_timeout_is_a_503() -> None:
    async def scenario() -> None:
        streamer = Streamer(PIECE_BYTES, write_timeout=0.05)
        await streamer.budget.take(1)  # a single byte held elsewhere is enough
        source = Source([b"x"])
        with pytest.raises(ServerBusyError, match="CKPTSTORE_MAX_UNSENT_BYTES") as caught:
            await streamer.open(source)
        assert caught.value.http_status == 503 and caught.value.code == "unavailable"
        assert source.closed and source.read == 0 and streamer.budget.held == 1

    run(scenario())
