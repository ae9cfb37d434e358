"""Manifest keys: '/'-joined paths whose parts are escaped like JSON Pointer (RFC 6901).

Escaping makes every key unambiguous even when a parameter name or a dict key holds '/':
``~`` becomes ``~0`` and ``/`` becomes ``~1``.
"""

from __future__ import annotations


def escape(part: object) -> str:
    """One path part, escaped."""
    text = str(part)
    if "~" not in text and "/" not in text:  # almost every part: a third of the time
        return text
    return text.replace("~", "~0").replace("/", "~1")


def unescape(part: str) -> str:
    """Undo :func:`escape`."""
    if "~" not in part:  # almost every part
        return part
    return part.replace("~1", "/").replace("~0", "~")


def join(*parts: object) -> str:
    """A key from its parts: join('optim', 'state', 'fc.weight', 'exp_avg')."""
    return "/".join(map(escape, parts))


def model_key(name: str) -> str:
    """The key of a model tensor named ``name`` in the model's state_dict."""
    return join("model", name)


def model_name(key: str) -> str:
    """The state_dict name behind a model key."""
    return unescape(key.removeprefix("model/"))
