"""Choosing how one tensor is stored at rest: grouped and compressed, or as a delta on its keyframe.

:mod:`service.reclaim.compression` asks, for every tensor a version added, which encoding of
:mod:`service.format.encoding` to store; this module answers from the tensor's bytes and its
keyframe's.
"""

from __future__ import annotations

from ckptstore.service.format import encoding

#: An encoding must save at least this share of a tensor's bytes to be stored.
MIN_GAIN = 0.03
#: A delta is stored only if it takes at most this share of the tensor stored whole: a load of it
#: reads and decodes its keyframe too, nearly twice the work for a saving of a quarter or less.
#: bf16 weights' deltas take 0.39-0.51x, fp32 weights' 0.6-0.85x. Young bf16 Adam ``exp_avg_sq``
#: (steps 30 to 40) takes 0.76-0.84x as a delta: at 0.8, 57 of its 78 tensors in the latest
#: version became deltas, storage fell by 0.008x and that version loaded 1.3x slower; settled
#: (after 200 steps) it takes 0.34-0.70x and is a delta at 0.7 too.
DELTA_AT_MOST = 0.7
#: Stretches of a tensor compressed both ways to choose between a keyframe and a delta: together
#: at most one :data:`SAMPLED_SHARE` of it, each between :data:`SAMPLE_MIN_BYTES` and
#: :data:`SAMPLE_BYTES` (a choice costs the collection an eighth of the tensor's encoding twice
#: over, where fixed 256 KiB samples of the 1-2 MiB tensors most models hold cost more than
#: compressing them).
SAMPLES = 4
SAMPLE_BYTES = 256 << 10
SAMPLE_MIN_BYTES = 16 << 10
SAMPLED_SHARE = 1 / 8


def choose(
    data: memoryview, width: int, base: memoryview | None, base_digest: str | None
) -> tuple[str, list[bytes]] | None:
    """``data`` grouped and compressed, or its delta against ``base`` where that takes at most
    :data:`DELTA_AT_MOST` of the former: the encoding's name and its payload's parts
    (:func:`~service.format.encoding.encode_parts`); None if neither saves :data:`MIN_GAIN`.

    Only the winner is compressed whole: a few samples spread over the tensor, compressed both
    ways, tell which way wins (compressing everything twice halved the collection's speed).
    """
    if base is not None:
        whole = delta = 0
        for part in samples(len(data)):
            whole += sum(map(len, encoding.encode_parts(data[part], width)))
            delta += sum(map(len, encoding.encode_parts(data[part], width, base=base[part], base_digest=base_digest)))
        if delta > DELTA_AT_MOST * whole:
            base = None
    if base is None:
        name, parts = "grouped-zstd", encoding.encode_parts(data, width)
    else:
        name, parts = "diff-grouped-zstd", encoding.encode_parts(data, width, base=base, base_digest=base_digest)
    return (name, parts) if sum(map(len, parts)) <= (1 - MIN_GAIN) * len(data) else None


def samples(nbytes: int) -> list[slice]:
    """:data:`SAMPLES` element-aligned stretches spread evenly over ``nbytes``, together at most
    :data:`SAMPLED_SHARE` of it (within the bounds of one stretch); the whole tensor if it is
    no longer than those stretches together."""
    size = min(SAMPLE_BYTES, max(SAMPLE_MIN_BYTES, int(nbytes * SAMPLED_SHARE) // SAMPLES)) // 8 * 8
    if nbytes <= SAMPLES * size:
        return [slice(0, nbytes)]
    step = nbytes // SAMPLES // 8 * 8  # element-aligned for every width
    return [slice(i * step, i * step + size) for i in range(SAMPLES)]


__all__ = [
    "DELTA_AT_MOST",
    "MIN_GAIN",
    "SAMPLED_SHARE",
    "SAMPLES",
    "SAMPLE_BYTES",
    "SAMPLE_MIN_BYTES",
    "choose",
    "samples",
]
