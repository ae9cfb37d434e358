"""How requests reach a ckptstore server: straight, or through the proxy the environment names.

The proxy is resolved once per client, for the server's URL, from ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (either case, as :func:`urllib.request.getproxies`
reads them) with httpx's rules: the scheme's own variable before ``ALL_PROXY``; a ``NO_PROXY``
entry ``*`` turns proxies off, ``host`` matches that host and its subdomains, ``.host`` only
subdomains, an IP address or ``localhost`` only itself, and ``scheme://host[:port]`` only that.
Loopback addresses are not exempt unless listed. JSON calls and shard bytes both go this one route.
"""

from __future__ import annotations

import base64
import ipaddress
import ssl
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit
from urllib.request import getproxies

import httpx

from ckptstore.service.errors import InvalidInputError


@dataclass(frozen=True)
class Route:
    """The way to one server.

    Attributes:
        url: the server's base URL, without a trailing slash.
        proxy: the proxy's URL (credentials included) or None to connect straight.
        tls: the TLS context for the server and the proxy (None where neither needs one).
    """

    url: str
    proxy: str | None = None
    tls: ssl.SSLContext | None = None

    @property
    def shown_proxy(self) -> str:
        """The proxy's URL without its credentials, for messages."""
        if self.proxy is None:
            return ""
        parts = urlsplit(self.proxy)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")

    def proxy_authorization(self) -> str | None:
        """The ``Proxy-Authorization`` value for a proxy URL with credentials (Basic), else None."""
        parts = urlsplit(self.proxy or "")
        if parts.username is None and parts.password is None:
            return None
        pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        return "Basic " + base64.b64encode(pair.encode()).decode("ascii")

    def httpx_proxy(self) -> httpx.Proxy | None:
        """The proxy for httpx (reached with this route's TLS context when it is an https:// one)."""
        if self.proxy is None:
            return None
        return httpx.Proxy(self.proxy, ssl_context=self.tls if self.proxy.startswith("https:") else None)


def route_for(url: str) -> Route:
    """The route to the server at ``url`` (``http(s)://host[:port][/prefix]``) from the environment.

    Raises:
        InvalidInputError: not an http(s) URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInputError(f"not an http(s) URL: {url[:80]!r}")
    base = url.rstrip("/")
    proxy = environment_proxy(base)
    tls = httpx.create_ssl_context(verify=True, trust_env=True) if needs_tls_context(base) else None
    return Route(base, proxy, tls)


def needs_tls_context(url: str) -> bool:
    """Whether a client for ``url`` must build a TLS context: not for a plain ``http://`` server
    reached without a proxy, where building one (loading the CA bundle) took 35-95 ms of every
    client's start and would never be used. Any proxy in the environment keeps it, as the
    proxy itself may be reached over TLS."""
    return urlsplit(url).scheme != "http" or bool(getproxies())


def environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (None: connect straight), as httpx picks it."""
    target = httpx.URL(url)
    found = getproxies()
    routes: dict[str, str | None] = {}
    for scheme in ("http", "https", "all"):
        if found.get(scheme):
            value = found[scheme]
            routes[f"{scheme}://"] = value if "://" in value else f"http://{value}"
    for entry in (item.strip() for item in found.get("no", "").split(",")):
        if entry == "*":
            return None
        if entry:
            routes[_no_proxy_pattern(entry)] = None
    patterns = {key: _Pattern.parse(key) for key in routes}
    for key in sorted(routes, key=lambda key: patterns[key].priority):
        if patterns[key].matches(target):
            return routes[key]
    return None


def _no_proxy_pattern(entry: str) -> str:
    """The URL pattern a ``NO_PROXY`` entry stands for (as httpx reads it)."""
    if "://" in entry:
        return entry
    address = entry.split("/")[0]
    if _is_ip(address):
        return f"all://[{entry}]" if ":" in address else f"all://{entry}"
    if entry.lower() == "localhost":
        return f"all://{entry}"
    return f"all://*{entry}"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class _Pattern:
    """A URL pattern: scheme ('' for any), host ('' for any; ``*x``: x and its subdomains,
    ``*.x``: only subdomains) and port (None for any or the scheme's default)."""

    scheme: str
    host: str
    port: int | None

    @classmethod
    def parse(cls, pattern: str) -> _Pattern:
        url = httpx.URL(pattern)
        return cls("" if url.scheme == "all" else url.scheme, "" if url.host == "*" else url.host, url.port)

    @property
    def priority(self) -> tuple[int, int, int]:
        """Most specific first: a port, then a longer host, then a longer scheme."""
        return (0 if self.port is not None else 1, -len(self.host), -len(self.scheme))

    def matches(self, url: httpx.URL) -> bool:
        """Whether ``url`` falls under this pattern."""
        if self.scheme and self.scheme != url.scheme:
            return False
        if self.host.startswith("*."):
            if not (url.host.endswith(self.host[1:]) and len(url.host) > len(self.host) - 1):
                return False
        elif self.host.startswith("*"):
            if url.host != self.host[1:] and not url.host.endswith("." + self.host[1:]):
                return False
        elif self.host and url.host != self.host:
            return False
        return self.port is None or self.port == url.port
