"""The one place where a server's error answer becomes the exception the embedded store raises.

Error answers carry ``{"code", "message"}`` (and ``X-Error-Code``); the code names the class
(:func:`service.errors.error_class_for_code`). JSON calls and shard bytes alike pass here.
"""

from __future__ import annotations

import json

from ckptstore.client.http.retry import Reply
from ckptstore.service.errors import (
    AuthenticationError,
    CheckpointError,
    MissingTensorsError,
    StateMismatchError,
    StorageError,
    StorageFullError,
    error_class_for_code,
)

#: What a refused token's error adds: where the client's token comes from (the token itself is never shown).
TOKEN_HINT = "set CKPTSTORE_TOKEN to a token this server accepts (client.Client(url, token=...) from Python)"
SCOPE_HINT = "set CKPTSTORE_TOKEN to a token of that scope (client.Client(url, token=...) from Python)"


def _with_token_hint(cls: type[CheckpointError], text: str) -> str:
    """A 401's or 403's message, told where the client's token is set."""
    if not issubclass(cls, AuthenticationError):
        return text
    hint = TOKEN_HINT if cls is AuthenticationError else SCOPE_HINT
    return f"{text.rstrip('. ')}: {hint}"


def raise_for_error(reply: Reply) -> None:
    """Raise the CheckpointError an error answer stands for; return on success."""
    status = reply.status_code
    if status < 400:
        return
    try:
        body = json.loads(reply.content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body, code, message = {}, "", reply.content[:500].decode("utf-8", "replace")
    else:
        code, message = str(body.get("code", "")), str(body.get("message", ""))
    code = code or reply.headers.get("x-error-code", "")
    cls = error_class_for_code(code)
    text = message or f"HTTP {status} from {reply.url}"
    if issubclass(cls, MissingTensorsError):
        raise cls(text, body.get("digests") or [])
    if issubclass(cls, StateMismatchError):
        raise cls(text)
    if cls is CheckpointError and status == StorageFullError.http_status:
        cls = StorageFullError  # a 507 without our code (a proxy's, an older server's) is a full disk too
    if cls is CheckpointError:
        fallback = StorageError if status >= 500 else CheckpointError
        raise fallback(f"HTTP {status}: {message}" if message else text)
    raise cls(_with_token_hint(cls, text))
