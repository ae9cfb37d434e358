"""Database and blob store URLs fit for a terminal or a log: every password-like part masked.

A URL reaches people in ``ckptstore serve``'s start line, ``ckptstore db upgrade``, the
``store:`` line of ``verify`` and the other commands, and the text of errors from S3 and the
database. :func:`mask_url` is what they show of it:

- the user-info password (``user:***@host``), as either parser that may read it does: urllib
  (user-info up to the last ``@`` before the first ``/``, ``?`` or ``#``) and SQLAlchemy (a
  password runs to the first ``@`` and may hold ``/``, ``?`` and ``#``); the user name is kept;
- the value of every query parameter whose name, in any case and after percent-decoding, is
  ``password`` or ``sslpassword`` or contains ``pass``, ``secret``, ``token``, ``key``,
  ``signature`` or ``credential`` (a presigned S3 URL's ``X-Amz-Signature`` and ``X-Amz-Credential``).

A URL it cannot read (no ``scheme://``, a control character, a port that is not a number, an
``@`` after its user-info) is shown as its scheme and ``***`` alone, never half-masked.
:func:`mask_urls` does the same for every URL inside a text (one ends at a space or a quote).
Torch-free and import-cheap: the server's commands use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import unquote, unquote_plus

MASK = "***"
#: Parts of a query parameter's name that make its value a secret (``password`` and
#: ``sslpassword`` contain ``pass``).
SECRET_WORDS = ("pass", "secret", "token", "key", "signature", "credential")
#: Percent-decoding rounds a name goes through (``%2570`` is ``p`` after two).
_DECODE_ROUNDS = 4

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: SQLAlchemy's reading of user-info: a user without ``:`` or ``/``, then ``:password@``.
_SQLALCHEMY_USERINFO = re.compile(r"[^:/]*:[^@]*@")
#: One ``host[:port]`` of a (libpq-style, comma-separated) host list; the port only digits.
_HOST = re.compile(r"(?:\[[0-9A-Za-z:.%]*\]|[^:\[\]]*)(?::[0-9]*)?")
#: A URL inside free text: it ends at whitespace, a quote or an angle bracket. It starts where a
#: run of scheme characters does (the look-behind), so a long run is scanned once, not once per
#: character: log lines pass through here (:mod:`service.api.redact`).
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>`]+")
#: A ``name=value`` query parameter inside free text.
_PARAMETER_IN_TEXT = re.compile(r"(?<=[?&;])([^=&;\s\"'<>?#]+)=([^&\s\"'<>]*)")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter called ``name`` holds a secret: its name, in any case, plain or
    percent-decoded (also as a form, ``+`` for space, up to four rounds), contains one of
    :data:`SECRET_WORDS`."""
    return any(word in form.casefold() for form in _decodings(name) for word in SECRET_WORDS)


def _decodings(text: str) -> Iterator[str]:
    forms = {text}
    for _ in range(_DECODE_ROUNDS):
        forms |= {decoded for form in forms for decoded in (unquote(form), unquote_plus(form))}
    return iter(forms)


def mask_url(url: str) -> str:
    """``url`` for display, with its user-info password and every secret query value replaced
    by ``***`` (see the module's description); ``scheme://***`` (or ``***``) for a URL it cannot
    read. Never raises."""
    try:
        return _masked(url)
    except Exception:  # a URL this cannot take apart is shown as its scheme alone
        return _opaque(url)


def mask_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`mask_url`, and any other secret-named
    ``name=value`` after a ``?``, ``&`` or ``;`` masked (a URL in text ends at a space, which a
    path may hold). For foreign error text, such as botocore's, which quotes the endpoint URL it
    failed to reach. Never raises."""
    try:
        masked = _URL_IN_TEXT.sub(_masked_url_in_text, text)
        return _PARAMETER_IN_TEXT.sub(_masked_match, masked)
    except Exception:
        return MASK


def _masked_url_in_text(found: re.Match[str]) -> str:
    """One URL found in text, masked; punctuation that ends a sentence (``http://h:1:``,
    ``http://h/x.``) is the text's, not the URL's, and stays as it was."""
    url = found.group()
    core = url.rstrip(".,:;!)]}")
    return mask_url(core) + url[len(core) :]


def _masked_match(found: re.Match[str]) -> str:
    return f"{found.group(1)}={MASK}" if is_secret_name(found.group(1)) else found.group()


def _opaque(url: object) -> str:
    scheme = _SCHEME.match(url) if isinstance(url, str) else None
    return f"{scheme.group(1)}://{MASK}" if scheme else MASK


def _masked(url: str) -> str:
    """Mask the union of what each parser's reading makes a secret, in the URL's own text."""
    scheme = _SCHEME.match(url)
    if scheme is None or _CONTROL.search(url):
        return _opaque(url)
    head, rest = url[: scheme.end()], url[scheme.end() :]
    urllib_at = rest.rfind("@", 0, _first(rest, "/?#"))
    sqlalchemy = _SQLALCHEMY_USERINFO.match(rest)
    at = max(urllib_at, sqlalchemy.end() - 1 if sqlalchemy else -1)
    spans: list[tuple[int, int]] = []
    if at >= 0:
        if "@" in rest[at + 1 :]:
            return _opaque(url)  # "u:pa/ss@word@host": part of the password would show as the host
        colon = rest.find(":", 0, at)
        if colon >= 0:
            spans.append((colon + 1, at))
    host = rest[at + 1 : _first(rest, "/?", at + 1)]
    if not all(_HOST.fullmatch(one) for one in host.split(",")):
        return _opaque(url)  # "user:secret/db" with no "@": the "port" may be a password
    # The query starts at the first "?" (urllib, and SQLAlchemy without user-info) or at the
    # first after the user-info (SQLAlchemy, whose password may hold a "?").
    for question in {rest.find("?"), rest.find("?", at + 1)} - {-1}:
        spans += _query_spans(rest, question + 1)
    return head + _replaced(rest, spans)


def _first(text: str, characters: str, start: int = 0) -> int:
    """The index of the first of ``characters`` in ``text`` from ``start``, else its length."""
    found = [index for index in (text.find(c, start) for c in characters) if index >= 0]
    return min(found, default=len(text))


def _query_spans(text: str, start: int) -> list[tuple[int, int]]:
    """The ``(begin, end)`` of every secret value in the query that starts at ``start``."""
    spans = []
    for begin, piece in _pieces(text[start:], "&", start):
        name, equals, _value = piece.partition("=")
        if equals and is_secret_name(name):
            spans.append((begin + len(name) + 1, begin + len(piece)))  # whatever ";" or "#" it holds
            continue
        # "a=1;password=x": a reader that splits at ";" too would see a password there.
        for sub_begin, sub in _pieces(piece, ";", begin):
            sub_name, sub_equals, _ = sub.partition("=")
            if sub_equals and is_secret_name(sub_name):
                spans.append((sub_begin + len(sub_name) + 1, sub_begin + len(sub)))
    return spans


def _pieces(text: str, separator: str, offset: int) -> Iterator[tuple[int, str]]:
    position = offset
    for piece in text.split(separator):
        yield position, piece
        position += len(piece) + len(separator)


def _replaced(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each of ``spans``, overlapping or touching ones merged, replaced by :data:`MASK`."""
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    shown, position = [], 0
    for begin, end in merged:
        shown += [text[position:begin], MASK]
        position = end
    return "".join(shown) + text[position:]
