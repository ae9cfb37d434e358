"""Dependencies shared by routes: the store, the settings, and scope checks."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from service.api.metrics import Metrics
from service.auth import Scope, TokenSet
from service.errors import InvalidInputError
from service.settings import Settings
from service.store import Store

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


def _require(scope: Scope) -> Any:
    def check(request: Request) -> None:
        if QUERY_TOKEN_NAMES & {name.lower() for name in request.query_params}:
            raise InvalidInputError("tokens are not accepted in the URL; send 'Authorization: Bearer <token>'")
        tokens: TokenSet = request.app.state.tokens
        if tokens.enabled:
            tokens.authorize(request.headers.get("authorization"), scope)

    return Depends(check)


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
CanRead = _require("read")
CanWrite = _require("write")
CanAdmin = _require("admin")
