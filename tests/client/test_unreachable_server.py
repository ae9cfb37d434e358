"""A Python client pointed at a server that is not there (a wrong ``CKPTSTORE_URL``, nothing
listening) fails within seconds with one line naming the URL, rather than retrying for the
whole budget meant for a server that restarts; a budget that was set is still honoured."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from ckptstore import client
from ckptstore.client.http.retry import DEFAULT_RETRY_SECONDS, FIRST_REACH_SECONDS, MAX_PAUSE_SECONDS
from tests.client.models import TinyNet

#: Generous: the first-contact budget, one last pause and the time to fail the last try.
WITHIN_SECONDS = 10.0


@pytest.fixture
def nobody() -> Iterator[str]:
    """The URL of a loopback port held bound but not listening: every connection is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("call", ["runs", "load", "save"])
def test_a_server_that_is_not_there_fails_within_seconds_naming_its_url(
    nobody: str, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_RETRY_SECONDS", raising=False)
    with client.Client(nobody) as ckpt:
        assert ckpt.transport.retry_seconds == DEFAULT_RETRY_SECONDS  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(client.StorageError) as caught:
            if call == "runs":
                ckpt.runs()
            elif call == "load":
                ckpt.load("run", model=TinyNet())
            else:
                ckpt.save("run", TinyNet())
        waited = time.monotonic() - started
    message = str(caught.value)
    assert waited < WITHIN_SECONDS < DEFAULT_RETRY_SECONDS
    assert FIRST_REACH_SECONDS + MAX_PAUSE_SECONDS < WITHIN_SECONDS
    assert "\n" not in message
    assert f"cannot reach the ckptstore server at {nobody}" in message and "CKPTSTORE_URL" in message


@pytest.mark.slow  # retries until its budget runs out
def test_a_budget_that_was_set_is_tried_in_full_before_the_server_first_answers(nobody: str) -> None:
    with client.Client(nobody, retry_seconds=FIRST_REACH_SECONDS + 1) as ckpt:
        started = time.monotonic()
        with pytest.raises(client.StorageError, match="cannot reach"):
            ckpt.runs()
        assert time.monotonic() - started >= FIRST_REACH_SECONDS + 1
