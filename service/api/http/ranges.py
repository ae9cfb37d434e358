"""What a shard download answers (RFC 9110): one byte range or a suffix, 416 past the end, 304 on a match.

Shards are immutable and content-addressed, so a shard's ETag is its quoted id and never
changes: ``If-None-Match`` with it is a 304, and the bytes may be cached for good by the
client that fetched them (``private``: the request carried a token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptstore.service.errors import InvalidInputError, RangeNotSatisfiableError

#: One range: ``bytes=first-[last]`` or the suffix ``bytes=-length``. ASCII digits only, 19 at most
#: (any larger number is past every shard and would not fit the store's integers).
_RANGE = re.compile(r"bytes=(?:([0-9]{1,19})-([0-9]{0,19})|-([0-9]{1,19}))", re.ASCII | re.IGNORECASE)
CACHE_CONTROL = "private, max-age=31536000, immutable"


@dataclass(frozen=True)
class Answer:
    """How to answer one GET or HEAD of a shard: the status, its headers, and which bytes."""

    status: int
    headers: dict[str, str]
    start: int = 0
    length: int = 0


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The first and last byte (inclusive) that a ``Range`` header asks of ``size`` bytes; None for all.

    An end past the last byte is clipped, and a suffix longer than the blob means all of it.

    Raises:
        InvalidInputError: not a single ``bytes=`` range, or a range that ends before it starts.
        RangeNotSatisfiableError: the range starts at or past ``size``, or is an empty suffix.
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        raise InvalidInputError(
            f"unsupported Range {header[:60]!r}: use one range, 'bytes=start-end', 'bytes=start-' or 'bytes=-length'"
        )
    first, last, suffix = match.groups()
    if suffix is not None:
        length = int(suffix)
        if length == 0 or size == 0:
            raise RangeNotSatisfiableError(f"Range {header[:60]!r} asks for no bytes of the shard's {size}", size)
        return max(size - length, 0), size - 1
    start = int(first)
    if last and int(last) < start:
        raise InvalidInputError(f"Range {header[:60]!r} ends before it starts")
    if start >= size:
        raise RangeNotSatisfiableError(
            f"Range {header[:60]!r} starts past the end of the shard's {size} bytes (the last byte is {size - 1})",
            size,
        )
    return start, min(int(last), size - 1) if last else size - 1


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``etag`` (weak comparison) or is ``*``."""
    if if_none_match is None:
        return False
    return any(tag.strip() in ("*", etag, "W/" + etag) for tag in if_none_match.split(","))


def answer(shard_id: str, size: int, range_header: str | None, if_none_match: str | None) -> Answer:
    """The answer to a GET (or HEAD) of shard ``shard_id`` of ``size`` bytes with these headers.

    ``If-None-Match`` is weighed before ``Range`` (RFC 9110 §13.2.2): a matching tag is a 304
    whatever range was asked for.

    Raises:
        InvalidInputError: a malformed Range.
        RangeNotSatisfiableError: a range outside the shard (answered 416 with ``bytes */size``).
    """
    etag = f'"{shard_id}"'
    headers = {"ETag": etag, "Cache-Control": CACHE_CONTROL, "Accept-Ranges": "bytes"}
    if etag_matches(if_none_match, etag):
        return Answer(304, headers)
    span = parse_range(range_header, size)
    if span is None:
        return Answer(200, {**headers, "Content-Length": str(size)}, 0, size)
    start, end = span
    length = end - start + 1
    headers.update({"Content-Length": str(length), "Content-Range": f"bytes {start}-{end}/{size}"})
    return Answer(206, headers, start, length)
