"""Requests a web page can forge: foreign ``Host`` names at a server with no tokens, and cross-site writes.

A server with no tokens (loopback only: :func:`service.api.app.check_auth_setup`) is still
reachable from any page the user's browser opens. DNS rebinding points a hostile name at
127.0.0.1, and the page then reads and deletes runs as a same-origin script of that name; a
cross-site form or ``fetch`` in ``no-cors`` mode sends a ``POST`` (``text/plain``, no preflight)
and the server acts on it even though the page never sees the answer. So, as plain ASGI ahead
of every route:

- with auth off, a request whose ``Host`` is not a loopback name (``localhost``, ``127.0.0.0/8``,
  ``[::1]``, any port) nor one the operator lists (``CKPTSTORE_ALLOWED_HOSTS``) is refused: 403,
  before any route runs. A request with no ``Host`` (HTTP/1.0 from a script) passes: browsers
  always send one;
- whatever the auth, a state-changing API request (any method but ``GET``, ``HEAD``, ``OPTIONS``;
  the pages' login and logout forms are checked by their own routes, answering with a page) that
  a browser marks as coming from another site is refused: ``Sec-Fetch-Site`` other than
  ``same-origin`` or ``none`` or, from a browser that sends no ``Sec-Fetch-Site``, an ``Origin``
  whose host and port are not the request's ``Host`` (``null`` included). Scripts and the
  Python client send neither header.

The JSON routes also take their bodies only as ``application/json``, even an empty one
(:class:`service.api.http.strict_json.StrictJSONRoute`), so a body-less cross-site ``POST`` cannot
reach them as a "simple" request either.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from ckptstore.service.api.errors import error_response
from ckptstore.service.errors import PermissionDeniedError

#: Methods that change nothing: a cross-site page may navigate to them (links to run pages).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: The API's routes; the pages' forms check their origin themselves (:func:`service.api.pages.views.check_origin`).
API_PREFIX = "/v1/"
#: ``Sec-Fetch-Site`` values of requests a page on this server, or the user, made.
OWN_SITE = frozenset({"same-origin", "none"})


def host_name(host: str) -> str:
    """The name of a ``Host`` header value, without its port, lowercased (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_allowed_hosts(spec: str | None) -> frozenset[str]:
    """The host names of ``CKPTSTORE_ALLOWED_HOSTS`` (comma-separated, ports ignored), lowercased."""
    return frozenset(host_name(part) for part in (spec or "").split(",") if part.strip())


def _origin_matches(origin: str, host: str | None) -> bool:
    """Whether ``Origin`` names the same host and port the request was sent to."""
    if host is None or origin == "null":
        return False
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    default = 443 if parts.scheme == "https" else 80
    named = host.strip().lower()
    origin_host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return named in (f"{origin_host}:{port or default}", *((origin_host,) if port in (None, default) else ()))


class SameSiteGuard:
    """Refuse foreign ``Host`` names (auth off) and cross-site state-changing requests (always).

    Args:
        app: the application inside.
        auth_off: the server takes requests without tokens.
        allowed_hosts: host names besides loopback that a server with auth off answers.
    """

    def __init__(self, app: ASGIApp, *, auth_off: bool, allowed_hosts: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.auth_off = auth_off
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection scope."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self.problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        await error_response(PermissionDeniedError.http_status, PermissionDeniedError.code, problem)(
            scope, receive, send
        )

    def problem(self, scope: Scope) -> str | None:
        """Why the request is refused, or None."""
        headers = {name: value for name, value in scope["headers"] if name in (b"host", b"origin", b"sec-fetch-site")}
        host = headers[b"host"].decode("latin-1") if b"host" in headers else None
        if self.auth_off and host is not None:
            name = host_name(host)
            if not is_loopback_name(name) and name not in self.allowed_hosts:
                return (
                    f"this server has no tokens and answers only loopback names, not Host {host[:100]!r}; "
                    "list the name in CKPTSTORE_ALLOWED_HOSTS, or set CKPTSTORE_TOKENS"
                )
        if scope["method"] in SAFE_METHODS or not scope["path"].startswith(API_PREFIX):
            return None  # the pages' forms are checked by their routes, answering with a page
        # The browser's own word first: behind a proxy that rewrites Host, Origin cannot be compared.
        site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower()
        if site:
            if site in OWN_SITE:
                return None
            return "a request from another site may not change this store (Sec-Fetch-Site); use the server's own pages"
        if b"origin" in headers and not _origin_matches(headers[b"origin"].decode("latin-1").strip(), host):
            return "a request from another origin may not change this store; use the server's own pages"
        return None


__all__ = ["SameSiteGuard", "host_name", "is_loopback_name", "parse_allowed_hosts"]
