"""Dependencies shared by routes: the store, the settings, the streamer of blob bytes, and scope checks."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from ckptstore.service.api.http.streaming import Streamer
from ckptstore.service.api.metrics import Metrics
from ckptstore.service.auth import Scope, TokenSet
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

QUERY_TOKEN_NAMES = {"token", "access_token", "api_key", "apikey", "key"}


def get_store(request: Request) -> Store:
    """The application's store."""
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    """The application's settings."""
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    """The application's counters."""
    return request.app.state.metrics


def get_streamer(request: Request) -> Streamer:
    """What opens the application's streamed answers of blob bytes under its memory budget."""
    return request.app.state.streamer


class ScopeCheck:
    """A route dependency that refuses requests without a token of ``scope`` (or with one in the URL).

    :class:`service.api.http.strict_json.StrictJSONRoute` also runs it before reading a JSON body,
    so a caller without a valid token never gets a body buffered or parsed.
    """

    def __init__(self, scope: Scope) -> None:
        self.scope: Scope = scope

    def __call__(self, request: Request) -> None:
        if QUERY_TOKEN_NAMES & {name.lower() for name in request.query_params}:
            raise InvalidInputError("tokens are not accepted in the URL; send 'Authorization: Bearer <token>'")
        tokens: TokenSet = request.app.state.tokens
        if tokens.enabled:
            tokens.authorize(request.headers.get("authorization"), self.scope)


def _require(scope: Scope) -> Any:
    return Depends(ScopeCheck(scope))


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
StreamerDep = Annotated[Streamer, Depends(get_streamer)]
CanRead = _require("read")
CanWrite = _require("write")
CanAdmin = _require("admin")
