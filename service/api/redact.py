"""Keep secrets out of the server's logs and redirects.

Tokens belong in the ``Authorization`` header; one sent in a URL is refused (400), but the
access log records the request before anyone looks at it. So what reaches a log is cut down:

- the access log's request target (:func:`loggable_target`) keeps the path, percent-decoded
  until it stops changing and cut at the first ``;`` (matrix parameters), ``?`` or ``#``, and
  the query string's parameters (``diff?a=run@1&b=run@2``, ``page=2`` stay readable) with the
  value replaced by ``***`` where it may bear a secret (:func:`_shown_value`): a secret-named
  parameter's (token, key, auth, bearer, secret, pass, session, sig, signature, credential, in
  any case, percent-decoded), a value holding such a word, an accepted token, or a run of
  letters and digits as random as a token's, and any value longer than :data:`LONGEST_VALUE`
  (a name longer than any word, as long as a token can be, is masked too, value and all);
- every other log line (:func:`redact`) has the values of token-like parameters masked, the
  names matched after percent-decoding, in any case;
- anywhere, a token this server accepts is replaced by ``***``, plain or percent-encoded;
- in every URL a line quotes (a database's, an S3 endpoint's), its password and secret-named
  query values (:func:`service.secrets_mask.mask_urls`).

The pages' ``/login?next=`` redirect carries :func:`safe_target`: no token-like parameter.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, quote, unquote, urlencode

from ckptstore.service.secrets_mask import is_secret_name, mask_urls

MASK = "***"
#: A query parameter name this long or longer may be a token (tokens have at least 16 characters).
LONGEST_NAME = 15
MAX_NAMES = 16
_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")
_SECRET_NAME = r"[^=&;\s?#]*(?:token|key|auth|bearer|secret|pass|session|sig|credential)[^=&;\s?#]*"
_SECRET_PARAM = re.compile(rf"(?i)((?:^|[?&;\s\x22\x27(])({_SECRET_NAME})=)[^&;\s\x22\x27]*")
_SECRET_WORD = re.compile(r"(?i)token|key|auth|bearer|secret|pass|session|sig|credential")
#: A query value longer than this is masked: no harmless parameter of the service needs more.
LONGEST_VALUE = 128
#: Letters-and-digits runs this long mixing both look like a token's randomness.
RANDOM_RUN = 12
_ALNUM_RUN = re.compile(rf"[A-Za-z0-9]{{{RANDOM_RUN},}}")
_secrets: set[str] = set()
LOGGERS = ("uvicorn.access", "uvicorn.error", "uvicorn.asgi", "ckptstore.api", "ckptstore.pages", "ckptstore.server")


def remember(secrets: Iterable[str]) -> None:
    """Add the tokens a server accepts to those masked wherever they appear in a log line."""
    _secrets.update(secret for secret in secrets if secret)


def decoded(text: str, rounds: int = 4) -> str:
    """``text`` percent-decoded until it stops changing (``%2574`` is ``t`` after two rounds)."""
    for _ in range(rounds):
        once = unquote(text)
        if once == text:
            break
        text = once
    return text


def _mask_secrets(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def safe_path(path: str) -> str:
    """A request path fit for a log or a redirect: decoded, cut at ``;``, ``?`` or ``#``, tokens
    masked, and percent-encoded again so no control character reaches the log."""
    plain = decoded(path)
    cut = min((at for at in map(plain.find, ";?#") if at >= 0), default=len(plain))
    return quote(_mask_secrets(plain[:cut]), safe="/-._~*")


def safe_target(path: str, query: str) -> str:
    """Where a redirect may send a browser back to: :func:`safe_path` and the query parameters
    whose names (decoded) look like no secret and whose values hold no accepted token."""
    kept = [
        (name, value)
        for name, value in parse_qsl(query, keep_blank_values=True)
        if _shown_name(name) != MASK
        and not _SECRET_PARAM.match(f"?{decoded(name)}=")
        and _mask_secrets(decoded(value)) == decoded(value)
    ]
    return safe_path(path) + (f"?{urlencode(kept)}" if kept else "")


def _shown_name(name: str) -> str:
    plain = decoded(name)
    if len(plain) > LONGEST_NAME or not _NAME.fullmatch(plain):
        return MASK
    return plain


def _random_run(text: str) -> bool:
    """Whether ``text`` holds a run of letters and digits as a token's: at least
    :data:`RANDOM_RUN` long, with both (``5e1d7c9a3b2f4e60``; not ``finetune``, not ``20240101``)."""
    return any(any(c.isdigit() for c in run) and any(c.isalpha() for c in run) for run in _ALNUM_RUN.findall(text))


def _shown_value(name: str, value: str) -> str:
    """A query value as the access log shows it: readable (percent-encoded again, so no control
    character reaches the log) unless it may bear a secret (see the module's description)."""
    plain = decoded(value)
    if (
        name == MASK
        or _SECRET_PARAM.match(f"?{decoded(name)}=")
        or is_secret_name(name)
        or len(plain) > LONGEST_VALUE
        or _SECRET_WORD.search(plain)
        or _mask_secrets(plain) != plain
        or _random_run(plain)
    ):
        return MASK
    return quote(plain, safe="@:/-._~,+!*'()")


def loggable_target(target: str) -> str:
    """An access-log request target (path and query): :func:`safe_path`, and the query's names
    with the values that may bear a secret masked (``/v1/runs?token=***&page=2``)."""
    path, _, query = target.partition("?")
    shown = safe_path(path)
    if not query:
        return shown
    pairs = parse_qsl(query, keep_blank_values=True)
    kept = [f"{name}={_shown_value(name, value)}" for name, value in ((_shown_name(n), v) for n, v in pairs)]
    if len(kept) > MAX_NAMES:
        kept[MAX_NAMES:] = ["…"]
    return f"{shown}?{'&'.join(kept)}"


def redact(text: str, *, urls: bool = True) -> str:
    """``text`` with the values of token-like parameters, every accepted token and (with ``urls``)
    the secrets of every URL in it (a database's or S3 endpoint's password:
    :func:`service.secrets_mask.mask_urls`) masked.

    Parameter names are matched after percent-decoding, so ``to%6ben=`` counts as ``token=``.
    Without ``urls`` (a %-format template such as ``"%s://%s:%d"``, which is no URL) the
    URL rule is left out.
    """
    if urls:
        text = mask_urls(text)
    plain = decoded(text)
    masked = _mask_secrets(_SECRET_PARAM.sub(rf"\1{MASK}", plain))
    return text if masked == plain else masked


class RedactTokens(logging.Filter):
    """A logging filter that makes a record safe to write (see the module's description).

    Records of ``uvicorn.access`` get their request target replaced by :func:`loggable_target`;
    every other string argument, the message and a formatted traceback go through :func:`redact`.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            if record.name == "uvicorn.access" and len(args) == 5 and isinstance(args[2], str):
                args = (*args[:2], loggable_target(args[2]), *args[3:])
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, urls=not record.args)  # a template's URLs are in its args
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install(token_spec: str | None = None) -> None:
    """Attach the filter to the loggers of uvicorn and of the service (once each), and mask the
    tokens of ``token_spec`` (``CKPTSTORE_TOKENS``: ``scope:token`` pairs) in every line.

    A logger's filters see only the records logged on it, not those of its children, hence the
    list; :func:`service.api.server.log_config` also filters the handlers ``ckptstore serve`` writes.
    """
    remember(item.strip().partition(":")[2] for item in (token_spec or "").split(","))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
