"""Bearer tokens with read / write / admin scopes, kept only as SHA-256 hashes.

Tokens come from ``CKPTSTORE_TOKENS`` as comma-separated ``scope:token`` pairs. A presented
token is hashed and compared against every known hash with ``hmac.compare_digest``, so the
comparison time does not depend on where a guess first differs. Tokens are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Literal

from ckptstore.service.errors import AuthenticationError, InvalidInputError, PermissionDeniedError

Scope = Literal["read", "write", "admin"]
SCOPE_RANK: dict[str, int] = {"read": 1, "write": 2, "admin": 3}
MAX_TOKEN_CHARS = 512


def _hash(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class TokenSet:
    """The accepted tokens, as (hash, scope) pairs."""

    entries: tuple[tuple[bytes, str], ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> TokenSet:
        """Read ``"read:abc,write:def"``; raises InvalidInputError naming a bad entry."""
        entries = []
        for position, item in enumerate(filter(None, (part.strip() for part in (spec or "").split(",")))):
            scope, _, token = item.partition(":")
            if scope not in SCOPE_RANK or len(token) < 16 or len(token) > MAX_TOKEN_CHARS:
                raise InvalidInputError(
                    f"CKPTSTORE_TOKENS entry {position + 1} must be read|write|admin:<token of 16-512 characters>"
                )
            entries.append((_hash(token), scope))
        return cls(tuple(entries))

    @property
    def enabled(self) -> bool:
        """True when at least one token is configured."""
        return bool(self.entries)

    def scope_of(self, token: str) -> str | None:
        """The scope of ``token``, or None if it is not known."""
        presented = _hash(token)
        found = None
        for digest, scope in self.entries:
            if hmac.compare_digest(digest, presented):
                found = scope
        return found

    def authorize(self, authorization: str | None, needed: Scope) -> None:
        """Check an ``Authorization`` header value grants ``needed``.

        Raises:
            AuthenticationError: missing, malformed or unknown token (401).
            PermissionDeniedError: a valid token of a lower scope (403).
        """
        if not authorization:
            raise AuthenticationError("this server requires a bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("the Authorization header must be 'Bearer <token>'")
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthenticationError("the bearer token is not valid")
        scope = self.scope_of(token)
        if scope is None:
            raise AuthenticationError("the bearer token is not valid")
        if SCOPE_RANK[scope] < SCOPE_RANK[needed]:
            article = "an" if needed[0] in "aeiou" else "a"
            raise PermissionDeniedError(f"this operation needs {article} {needed} token; yours is {scope}")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
