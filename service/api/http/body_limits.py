"""How large a JSON body each API route accepts, sized to what the route needs.

A route's limit follows from its body model. Every limit is also capped by the
``max_json_bytes`` setting (``CKPTSTORE_MAX_JSON_BYTES``), which is itself the limit of a
commit, the one body that grows with the model being saved:

==============================  ==========================  ==============================
Body                            Limit                       Why
==============================  ==========================  ==============================
a commit (``CommitRequest``)    ``max_json_bytes`` (8 MiB)   a manifest of ~30,000 tensors
a digest list (``DigestList``)  8 MiB                       100,000 digests, pretty-printed
shard ranges (``RangeBatch``)   1 MiB                       4,096 ranges, pretty-printed
anything else                   64 KiB                      a tag, a policy, gc options
==============================  ==========================  ==============================

A body is also refused before it is parsed when its separators show it is not what the route
reads, so that what it would cost to parse stays a small multiple of its size: a digest list
holding more ``:`` or ``,`` than one can (a million unknown keys cost a byte count, not a parse),
or a commit holding more than one array or object for every 16 bytes (a manifest holds about
one for every 100; a body of empty arrays would take 45 times its size in memory, twice).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptstore.service.api.http.range_batch import MAX_RANGES
from ckptstore.service.api.schemas import MAX_DIGESTS, CommitRequest, DigestList, RangeBatch
from ckptstore.service.errors import InvalidInputError

SETTING = "CKPTSTORE_MAX_JSON_BYTES"
#: ``"<64 hex>",`` plus a newline and indentation for each digest, and the braces around them.
DIGEST_LIST_BYTES = 8 << 20
SMALL_BODY_BYTES = 64 << 10
#: ``{"shard_id": "<64 hex>", "offset": ..., "length": ...},`` with indentation, per range.
RANGE_BATCH_BYTES = 1 << 20
#: Arrays and objects any body may hold besides its share by size (a small body's few).
CONTAINER_ALLOWANCE = 64


@dataclass(frozen=True)
class BodyLimit:
    """A route's body limit and, optionally, bounds on the body's shape checked before parsing.

    Attributes:
        max_bytes: the limit in bytes; None for the ``max_json_bytes`` setting itself.
        max_colons: the most ``:`` the body may hold (object members, counted before parsing).
        max_commas: the most ``,`` the body may hold (items and members).
        bytes_per_container: the body may hold one ``[`` or ``{`` for every this many bytes.
        shape: what a valid body looks like, for the message refusing one.
    """

    max_bytes: int | None
    max_colons: int | None = None
    max_commas: int | None = None
    bytes_per_container: int | None = None
    shape: str = ""

    def bytes_within(self, ceiling: int) -> int:
        """The limit under a ``max_json_bytes`` of ``ceiling``."""
        return ceiling if self.max_bytes is None else min(self.max_bytes, ceiling)

    def setting_for(self, ceiling: int) -> str | None:
        """The setting that raises this limit, or None where it is fixed by the route."""
        return SETTING if self.max_bytes is None or ceiling < self.max_bytes else None

    def check_shape(self, body: bytes) -> None:
        """Refuse a body holding more separators than any valid one (byte counts, no parse)."""
        for mark, most, what in ((b":", self.max_colons, "object members"), (b",", self.max_commas, "items")):
            if most is not None and (found := body.count(mark)) > most:
                raise InvalidInputError(
                    f"the body holds {found} {mark.decode()!r} separators, more {what} than this route "
                    f"reads (at most {most}): it takes {self.shape}"
                )
        if self.bytes_per_container is not None:
            containers = body.count(b"[") + body.count(b"{")
            if containers > len(body) // self.bytes_per_container + CONTAINER_ALLOWANCE:
                raise InvalidInputError(
                    f"the body holds {containers} JSON arrays and objects in {len(body)} bytes; this route "
                    f"reads at most one for every {self.bytes_per_container} bytes ({self.shape})"
                )


DIGEST_LIST = BodyLimit(
    DIGEST_LIST_BYTES,
    max_colons=64,
    max_commas=MAX_DIGESTS + 64,
    shape=f'one object {{"digests": [...]}} of up to {MAX_DIGESTS} digests',
)
RANGE_BATCH = BodyLimit(
    RANGE_BATCH_BYTES,
    max_colons=3 * MAX_RANGES + 64,
    max_commas=3 * MAX_RANGES + 64,
    bytes_per_container=64,
    shape=f'one object {{"ranges": [{{"shard_id", "offset", "length"}}, ...]}} of up to {MAX_RANGES} ranges',
)
COMMIT = BodyLimit(
    None, bytes_per_container=16, shape="a manifest holds about one for every 100 bytes, its state far fewer"
)
SMALL = BodyLimit(SMALL_BODY_BYTES)
LIMITS: dict[object, BodyLimit] = {DigestList: DIGEST_LIST, RangeBatch: RANGE_BATCH, CommitRequest: COMMIT}


def limit_for(body_model: object) -> BodyLimit:
    """The limit of a route whose body is ``body_model`` (the small limit for any other model)."""
    return LIMITS.get(body_model, SMALL)
