"""Keep secrets out of access logs: tokens sent in a query string are masked before logging.

Such requests are refused (tokens belong in the Authorization header), but the server's access
log would otherwise record the URL, token included.
"""

from __future__ import annotations

import logging
import re

_SECRET_QUERY = re.compile(r"(?i)([?&](?:token|access_token|api_key|apikey|key)=)[^&\s]*")


def redact(text: str) -> str:
    """``text`` with the values of token-like query parameters replaced by ``***``."""
    return _SECRET_QUERY.sub(r"\1***", text)


class RedactTokens(logging.Filter):
    """A logging filter masking token-like query parameters in a record's arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        record.msg = redact(record.msg) if isinstance(record.msg, str) else record.msg
        return True


def install() -> None:
    """Attach the filter to uvicorn's access and error loggers (once)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())
