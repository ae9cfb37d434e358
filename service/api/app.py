"""The FastAPI application: routes, error handlers, auth and metrics around one Store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ckptstore.service import __version__
from ckptstore.service.api import docs, redact
from ckptstore.service.api.errors import install_error_handlers
from ckptstore.service.api.http.middleware import MAX_HEADER_BYTES, CountAndLimit
from ckptstore.service.api.http.same_site import SameSiteGuard, parse_allowed_hosts
from ckptstore.service.api.http.streaming import Streamer
from ckptstore.service.api.metrics import Metrics
from ckptstore.service.api.pages import views as pages
from ckptstore.service.api.routes import admin, data, ops, retention, runs, uploads
from ckptstore.service.api.warm_up import warm_up
from ckptstore.service.auth import TokenSet, is_loopback
from ckptstore.service.errors import AuthenticationError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

__all__ = ["MAX_HEADER_BYTES", "check_auth_setup", "create_app"]


def check_auth_setup(tokens: TokenSet, host: str) -> None:
    """Refuse to serve without tokens anywhere but on loopback."""
    if not tokens.enabled and not is_loopback(host):
        raise AuthenticationError(
            f"refusing to serve on {host} without tokens: set CKPTSTORE_TOKENS (e.g. 'write:<secret>') "
            "or bind to 127.0.0.1"
        )


def create_app(store: Store, settings: Settings | None = None) -> FastAPI:
    """Build the application serving ``store``.

    Auth is off only when no tokens are configured and ``settings.host`` is a loopback
    address; otherwise every route but /healthz and /metrics needs a bearer token (the HTML
    pages and /docs also take it from the cookie /login sets; /login and /static are open).
    With auth off only loopback ``Host`` names (and ``settings.allowed_hosts``) are answered,
    and cross-site state-changing requests are refused always (:mod:`service.api.http.same_site`).
    """
    settings = settings or Settings()
    tokens = TokenSet.parse(settings.tokens)
    check_auth_setup(tokens, settings.host)
    redact.install(settings.tokens)
    app = FastAPI(
        title="ckptstore",
        version=__version__,
        description="A checkpoint store for PyTorch training: content-addressed safetensors shards and manifests.",
        # No trailing-slash redirects: their Location is built from the decoded request path, so
        # '/v1/runs/x/versions/.%2f' would send a client on to '/v1/runs/x/versions/.' and, once
        # it resolves the dot segment, to the commit route. A path that is not a route is a 404.
        redirect_slashes=False,
        # FastAPI's own /docs and /redoc load scripts and fonts from public CDNs and need no token;
        # service.api.docs serves /openapi.json and /docs instead (token, shipped assets, a CSP).
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=_lifespan,
    )
    app.state.store = store
    app.state.settings = settings
    app.state.tokens = tokens
    app.state.metrics = Metrics()
    app.state.streamer = Streamer(settings.max_unsent_bytes, settings.write_timeout)
    install_error_handlers(app)
    app.include_router(data.router)
    app.include_router(uploads.router)
    app.include_router(runs.router)
    app.include_router(retention.router)
    app.include_router(admin.router)
    app.include_router(ops.router)
    app.include_router(pages.router)
    app.include_router(docs.api_router)
    app.include_router(docs.page_router)
    app.mount("/static", pages.static_files(), name="static")

    app.add_middleware(
        SameSiteGuard, auth_off=not tokens.enabled, allowed_hosts=parse_allowed_hosts(settings.allowed_hosts)
    )
    app.add_middleware(CountAndLimit, metrics=app.state.metrics, max_json_bytes=settings.max_json_bytes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """A worker's start: its routes are built before it takes a connection (:mod:`service.api.warm_up`)."""
    await warm_up(app)
    yield
