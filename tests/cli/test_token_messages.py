"""A server that refuses the client's token says where the token comes from: a 401 (no token,
an unknown one) and a 403 (a token of too low a scope) tell to set ``CKPTSTORE_TOKEN``, from
Python and on the command line, and never print the token that was sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.service.api import create_app
from ckptstore.service.errors import AuthenticationError, PermissionDeniedError
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.api.kit import READ_TOKEN, TOKENS
from tests.servers import running_server

WRONG_TOKEN = "not-a-token-of-this-server-7d1e"


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    """A server that wants tokens."""
    settings = Settings(home=tmp_path / "server", tokens=TOKENS)
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings)) as served:
            yield served
    finally:
        store.close()


@pytest.mark.parametrize("token", [None, WRONG_TOKEN])
def test_a_refused_token_tells_to_set_ckptstore_token_and_never_shows_it(url: str, token: str | None) -> None:
    with client.Client(url, token=token) as ckpt, pytest.raises(AuthenticationError) as caught:
        ckpt.runs()
    message = str(caught.value)
    assert "set CKPTSTORE_TOKEN" in message and WRONG_TOKEN not in message

    env = {"CKPTSTORE_URL": url, "CKPTSTORE_TOKEN": token, "CKPTSTORE_HOME": None}
    result = CliRunner().invoke(app, ["ls"], env=env)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "set CKPTSTORE_TOKEN" in result.stderr and WRONG_TOKEN not in result.output + result.stderr


def test_a_token_of_too_low_a_scope_tells_which_scope_and_where_to_set_it(url: str) -> None:
    with client.Client(url, token=READ_TOKEN) as ckpt:
        assert ckpt.runs() == []
        with pytest.raises(PermissionDeniedError) as caught:
            ckpt.gc(dry_run=True)
    message = str(caught.value)
    assert "admin" in message and "set CKPTSTORE_TOKEN" in message and READ_TOKEN not in message
