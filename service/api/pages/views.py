"""The HTML pages: runs, a run's versions, one version's tensors, a diff, and login.

Routes only parse parameters, call :mod:`service.api.pages.data` in a worker thread and render a
template. Every route goes through :class:`PageRoute`, so an error on a page is an HTML page
with its status (or, for a browser without a token, a redirect to /login) while the JSON API's
error handling stays as it is. Pages need a read token when tokens are configured, taken from
the ``Authorization`` header or the ``ckptstore_token`` cookie that /login sets.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Coroutine
from pathlib import Path as FilePath
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jinja2
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptstore.service import __version__
from ckptstore.service.api import redact
from ckptstore.service.api.deps import QUERY_TOKEN_NAMES, StoreDep, StreamerDep
from ckptstore.service.api.errors import public_message
from ckptstore.service.api.pages import compare as pages_compare
from ckptstore.service.api.pages import data as pages_data
from ckptstore.service.api.pages import formatting as pages_format
from ckptstore.service.api.pages.runs import plural
from ckptstore.service.api.pages.tensor_values import MAX_COMPARED_BYTES
from ckptstore.service.auth import MAX_TOKEN_CHARS, TokenSet
from ckptstore.service.errors import AuthenticationError, CheckpointError, InvalidInputError, PermissionDeniedError
from ckptstore.service.format.manifest import manifest_to_json

log = logging.getLogger("ckptstore.pages")

HERE = FilePath(__file__).resolve().parent
COOKIE = "ckptstore_token"
MAX_FORM_BYTES = 4096
#: Scripts, styles and forms from this server only; no inline script can run even if markup slipped through.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: Methods that change nothing; a page route with any other method gets :func:`check_origin`.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LOCAL_PATH = re.compile(r"^/(?![/\\])[\x21-\x7e]*$")

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True, undefined=jinja2.StrictUndefined
)
_env.filters.update(
    sized=pages_format.sized,
    size=pages_format.human_size,
    pct=pages_format.percent,
    num=pages_format.number,
    when=pages_format.when,
    shape=pages_format.shape,
    breakable=pages_format.breakable,
)
_env.globals.update(
    run_url=pages_data.run_url,
    version_url=pages_data.version_url,
    plural=plural,
    max_compared=MAX_COMPARED_BYTES,
    max_compared_runs=pages_compare.MAX_RUNS,
    app_version=__version__,
)
templates = Jinja2Templates(env=_env)


def static_files() -> StaticFiles:
    """The stylesheet and script the pages load from /static."""
    return StaticFiles(directory=HERE / "static")


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
    """Render template ``name`` with the login state every page header shows."""
    tokens: TokenSet = request.app.state.tokens
    context.update(auth_enabled=tokens.enabled, logged_in=COOKIE in request.cookies)
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=HEADERS)


def local_target(target: str | None) -> str:
    """``target`` if it is a path on this server, else '/': /login never redirects off-site."""
    return target if target and _LOCAL_PATH.fullmatch(target) else "/"


def _describe(exc: RequestValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg', '')}" for e in exc.errors()[:5])


def error_page(request: Request, exc: Exception) -> Response:
    """The HTML answer to an error raised by a page route."""
    if type(exc) is AuthenticationError and not request.headers.get("authorization") and request.method == "GET":
        # Without any token-like parameter (?ckptstore_token=…): a redirect's URL ends up in
        # browser history and the access log.
        here = redact.safe_target(request.url.path, request.url.query)
        return RedirectResponse("/login?" + urlencode({"next": here}), status_code=303, headers=HEADERS)
    if isinstance(exc, CheckpointError):
        status, code, message = exc.http_status, exc.code, public_message(request, exc)
    elif isinstance(exc, RequestValidationError):
        status, code, message = 422, "invalid_input", "invalid request: " + _describe(exc)
    elif isinstance(exc, StarletteHTTPException):
        status, code, message = exc.status_code, "http_error", str(exc.detail)
    else:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        status, code, message = 500, "internal", "internal server error; the server log has the details"
    response = render(request, "error.html", status, status=status, code=code, message=message)
    response.headers["X-Error-Code"] = code
    return response


def check_origin(request: Request) -> None:
    """Refuse a form that a browser says was sent from another site (cross-site request forgery).

    The browser's ``Origin`` (or, without one, its ``Referer``) must name this server's host.
    A request carrying neither is let through, as it is from no browser form: browsers send
    ``Origin`` with every POST, and ``Origin: null`` (a sandboxed or privacy-redirected page)
    counts as another site.
    """
    source = request.headers.get("origin") or request.headers.get("referer")
    if source is None:
        return
    if urlsplit(source).netloc.lower() != request.headers.get("host", "").lower():
        raise PermissionDeniedError(
            f"this form was sent from another site ({source[:100]}), so it was not acted on; "
            f"open {request.url.path} on this server and send it from there"
        )


class PageRoute(APIRoute):
    """A route whose errors become HTML error pages instead of the API's JSON.

    Every page route that can change something (any method but GET, HEAD and OPTIONS: the
    login and logout forms) is refused when sent from another site (:func:`check_origin`).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def page_handler(request: Request) -> Response:
            try:
                if request.method not in SAFE_METHODS:
                    check_origin(request)
                return await handler(request)
            except Exception as exc:  # every error on a page is answered with a page
                return error_page(request, exc)

        return page_handler


def read_access(request: Request) -> None:
    """Require a read token (header or cookie) when tokens are configured; never one in the URL."""
    if QUERY_TOKEN_NAMES & {name.lower() for name in request.query_params}:
        raise InvalidInputError("tokens are not accepted in the URL; log in at /login instead")
    tokens: TokenSet = request.app.state.tokens
    if tokens.enabled:
        cookie = request.cookies.get(COOKIE)
        tokens.authorize(request.headers.get("authorization") or (f"Bearer {cookie}" if cookie else None), "read")


router = APIRouter(route_class=PageRoute, include_in_schema=False)
CanReadPages = [Depends(read_access)]
RunId = Annotated[str, Path(max_length=128)]
Ref = Annotated[str, Path(max_length=64)]


Order = Annotated[pages_data.Order, Query()]
MetricQuery = Annotated[str | None, Query(max_length=128)]


@router.get("/", dependencies=CanReadPages)
async def runs_page(
    request: Request,
    store: StoreDep,
    q: Annotated[str, Query(max_length=100, description="text in a run id or a tag")] = "",
    sort: Annotated[str, Query(max_length=20)] = "saved",
    order: Order = "desc",
    metric: MetricQuery = None,
) -> Response:
    """Every run (those whose id or a tag holds ``q``) with its sizes, newest version, metric and tags."""
    index = await run_in_threadpool(pages_data.runs_index, store, q=q, sort=sort, order=order, metric=metric)
    return render(request, "runs.html", index=index)


@router.get("/runs/{run_id}", dependencies=CanReadPages)
async def run_page(
    request: Request,
    run_id: RunId,
    store: StoreDep,
    page: Annotated[int, Query(ge=1, le=10**9)] = 1,
    per_page: Annotated[int, Query(ge=1, le=500)] = pages_data.PER_PAGE,
    sort: Annotated[str, Query(max_length=140)] = "version",
    order: Order = "desc",
    tag: Annotated[str | None, Query(max_length=64, description="a tag name or glob")] = None,
    metric: MetricQuery = None,
    low: Annotated[str | None, Query(alias="min", max_length=40)] = None,
    high: Annotated[str | None, Query(alias="max", max_length=40)] = None,
) -> Response:
    """A run's charts and versions, filtered, sorted over all of them and paginated."""
    chosen = pages_data.RunFilter.parse(tag, metric, low, high)
    data = await run_in_threadpool(
        pages_data.run_page, store, run_id, page=page, per_page=per_page, sort=sort, order=order, filter=chosen
    )
    return render(request, "run.html", run=data)


@router.get("/runs/{run_id}/versions/{ref}", dependencies=CanReadPages)
async def version_page(
    request: Request,
    run_id: RunId,
    ref: Ref,
    store: StoreDep,
    q: Annotated[str, Query(max_length=200, description="text in a tensor key, or a glob")] = "",
) -> Response:
    """One version: its figures, how to load it and its tensors by section (those matching ``q``)."""
    data = await run_in_threadpool(pages_data.version_page, store, run_id, ref, q)
    server = str(request.base_url).rstrip("/")
    return render(request, "version.html", run_id=run_id, v=data, server=server)


@router.get("/runs/{run_id}/versions/{ref}/manifest.json", dependencies=CanReadPages)
async def manifest_download(run_id: RunId, ref: Ref, store: StoreDep) -> Response:
    """The manifest JSON, as the API serves it, for a browser holding the login cookie."""
    manifest = await run_in_threadpool(store.manifest, run_id, ref)
    disposition = f'attachment; filename="{manifest.run_id}-v{manifest.version}.manifest.json"'
    headers = {"Content-Disposition": disposition, "X-Content-Type-Options": "nosniff"}
    return Response(manifest_to_json(manifest), media_type="application/json", headers=headers)


@router.get("/runs/{run_id}/versions/{ref}/tensor", dependencies=CanReadPages)
async def tensor_download(
    run_id: RunId,
    ref: Ref,
    store: StoreDep,
    streamer: StreamerDep,
    name: Annotated[str, Query(min_length=1, max_length=1100)],
) -> Response:
    """One whole tensor's raw little-endian bytes (``name`` is its key; ``?key=`` reads as a token)."""
    found = await run_in_threadpool(pages_data.tensor_download, store, run_id, ref, name)
    headers = {
        "Content-Length": str(found.nbytes),
        "Content-Disposition": f'attachment; filename="{found.filename}"',
        "X-Content-Type-Options": "nosniff",
    }
    return await streamer.open(found.chunks, headers=headers)


@router.get("/runs/{run_id}/diff", dependencies=CanReadPages)
async def diff_page(
    request: Request,
    run_id: RunId,
    store: StoreDep,
    a: Annotated[str | None, Query(max_length=64)] = None,
    b: Annotated[str | None, Query(max_length=64)] = None,
    v: Annotated[list[str] | None, Query(description="the rows ticked in the run page's form")] = None,
    show_all: Annotated[bool, Query(alias="all")] = False,
    values: Annotated[bool, Query(description="read and compare the changed tensors' values")] = False,
) -> Response:
    """What changed between versions ``a`` and ``b`` (or the two ticked rows, older first)."""
    first, second, by_number = pages_data.pick_pair(a, b, v or [])
    data = await run_in_threadpool(
        pages_data.diff_page, store, run_id, first, second, by_number=by_number, show_all=show_all, compare=values
    )
    return render(request, "diff.html", d=data)


@router.get("/compare", dependencies=CanReadPages)
async def compare_page(
    request: Request,
    store: StoreDep,
    run: Annotated[list[str] | None, Query(description="a run to compare; two to eight of them")] = None,
    show_all: Annotated[bool, Query(alias="all", description="also the values every run shares")] = False,
) -> Response:
    """Several runs: each metric as one chart with a line per run, and their newest versions' values."""
    chosen = pages_compare.pick_runs(run or [])
    data = await run_in_threadpool(pages_compare.compare_page, store, chosen, show_all=show_all)
    return render(request, "compare.html", c=data)


# -- login --------------------------------------------------------------------------------------


async def read_form(request: Request) -> dict[str, str]:
    """A small urlencoded form body (first value of each field); 413 past MAX_FORM_BYTES."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(413, f"the form is larger than {MAX_FORM_BYTES} bytes")
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    return {name: values[0] for name, values in fields.items()}


@router.get("/login")
async def login_form(
    request: Request, target: Annotated[str | None, Query(alias="next", max_length=2000)] = None
) -> Response:
    """The form that stores a token in the login cookie."""
    return render(request, "login.html", next=local_target(target), error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the token and keep it in an HttpOnly, SameSite=Strict cookie."""
    form = await read_form(request)
    target = local_target(form.get("next"))
    tokens: TokenSet = request.app.state.tokens
    token = form.get("token", "").strip()
    if tokens.enabled and (len(token) > MAX_TOKEN_CHARS or tokens.scope_of(token) is None):
        return render(request, "login.html", 401, next=target, error="That token is not valid on this server.")
    response = RedirectResponse(target, status_code=303, headers=HEADERS)
    if tokens.enabled:
        secure = request.url.scheme == "https"
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure, path="/")
    return response


@router.get("/logout")
async def logout_form(request: Request) -> Response:
    """A button that logs out (a POST, so a link on another site cannot)."""
    return render(request, "logout.html")


@router.post("/logout")
async def logout() -> Response:
    """Forget the login cookie (a form from another site is refused before this runs)."""
    response = RedirectResponse("/login", status_code=303, headers=HEADERS)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response
