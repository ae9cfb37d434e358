"""What a DCP ``.metadata`` claims about where its data lies, checked before a byte of data is read.

- :func:`check_cover`: a tensor's chunks lie inside it and cover it exactly once (no gap, no
  overlap), so every stored element comes from the source, once.
- :func:`check_regions`: the items the checkpoint reads (tensor chunks and byte entries) lie in
  disjoint regions of the folder's files, so no stored item is read twice: a small folder cannot
  make a large state by naming one item many times.

Both run in ``n log n`` (or linear) time in the number of chunks or items, whatever their layout.

Why the cover check is a polynomial identity test rather than a sweep for overlapping pairs:
deciding whether boxes in many dimensions overlap has no known fast exact algorithm (a sweep on
one dimension leaves every box that shares a slab to be compared pairwise: 16,384 chunks cut along
14 dimensions took minutes). Counting coverage instead works in any dimension. Compress each
dimension to the cells between the chunks' boundaries; the chunks tile the tensor exactly when the
coverage count ``f(c) = #{chunks holding cell c} - 1`` is zero on every cell ``c``. Give each cell
of each dimension ``k`` an independent random weight ``w[k][t]`` modulo a prime ``p``; then

    sum over chunks of prod_k (sum of w[k][t] over the chunk's cells t on k)  -  the same for the tensor
      = sum over cells c of f(c) * prod_k w[k][c_k],

a multilinear polynomial in the weights whose monomials are distinct per cell. It is the zero
polynomial exactly when every ``f(c)`` is zero (``|f| <= chunks < p``), and otherwise vanishes at a
random point with probability at most ``dims / p`` (Schwartz-Zippel). A valid layout is therefore
always accepted; an invalid one passes :data:`ROUNDS` independent rounds with probability below
``(64 / (2**31 - 1)) ** 5 < 2**-120``. The weights come from a generator seeded by :mod:`secrets`,
so no file can be made to meet them.
"""

from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Callable, Sequence

import torch

from ckptstore.service.errors import InvalidInputError

Box = tuple[tuple[int, ...], tuple[int, ...]]
#: The largest size of one dimension: coordinates are computed in 64-bit integers.
MAX_DIMENSION = 1 << 62
#: The prime the identity test computes modulo (products of two residues fit in 64 bits), and its rounds.
PRIME = (1 << 31) - 1
ROUNDS = 5


def check_cover(size: tuple[int, ...], chunks: Sequence[Box], what: str) -> None:
    """Refuse chunks ``(offsets, sizes)`` that leave part of a tensor of ``size`` uncovered, overlap,
    or lie outside it.

    Raises:
        InvalidInputError: naming ``what`` and, where one is to blame, the chunk at fault.
    """
    ndim = len(size)
    for offsets, sizes in chunks:
        if len(offsets) != ndim or len(sizes) != ndim:
            raise InvalidInputError(f"{what}: a chunk has {len(offsets)} dimensions, the tensor {ndim}")
        if any(map(operator.gt, map(operator.add, offsets, sizes), size)):
            raise InvalidInputError(f"{what}: chunk at {list(offsets)} of {list(sizes)} reaches outside {list(size)}")
    if any(d >= MAX_DIMENSION for d in size):
        raise InvalidInputError(f"{what}: a dimension of {max(size)} elements is past the limit of {MAX_DIMENSION}")
    total = math.prod(size)
    if total == 0:
        return
    live = [c for c in chunks if 0 not in c[1]]
    covered = sum(math.prod(sizes) for _, sizes in live)
    if covered > total:
        raise InvalidInputError(
            f"{what}: its chunks hold {covered} elements where it has {total}, so chunks overlap; each element "
            "must be stored once"
        )
    if covered < total:
        raise InvalidInputError(
            f"{what}: its chunks hold {covered} of its {total} elements, so part of it is left uncovered (more of "
            "it, if chunks also overlap); the checkpoint is incomplete"
        )
    seen: set[tuple[int, ...]] = set()
    for offsets, _ in live:
        if offsets in seen:
            raise InvalidInputError(
                f"{what}: two chunks start at {list(offsets)}, so they overlap; each element must be stored once"
            )
        seen.add(offsets)
    if len(live) > 1 and not _tiles(size, live):
        raise InvalidInputError(
            f"{what}: its chunks overlap: they hold as many elements as it has, but some twice, leaving others "
            "uncovered; each element must be stored once"
        )


def _tiles(size: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether ``boxes`` (each inside ``size``, not empty) cover every element exactly once, by the
    identity test in the module's docstring."""
    starts = torch.tensor([offsets for offsets, _ in boxes], dtype=torch.int64).T
    extents = torch.tensor([sizes for _, sizes in boxes], dtype=torch.int64).T
    full = torch.tensor(size, dtype=torch.int64)
    cut = (extents != full[:, None]).any(dim=1).nonzero().flatten().tolist()  # the others add a factor of 1
    if not cut:
        return len(boxes) == 1
    starts, ends = starts[cut].contiguous(), (starts[cut] + extents[cut]).contiguous()
    generator = torch.Generator().manual_seed(secrets.randbits(63))
    chunks_sum = torch.ones(ROUNDS, len(boxes), dtype=torch.int64)
    tensor_sum = torch.ones(ROUNDS, dtype=torch.int64)
    for row, k in enumerate(cut):
        edges = torch.cat([starts[row], ends[row], torch.tensor([0, size[k]], dtype=torch.int64)])
        edges = torch.unique_consecutive(torch.sort(edges).values)  # cell t: edges[t] to edges[t + 1]
        weights = torch.randint(0, PRIME, (ROUNDS, len(edges) - 1), generator=generator, dtype=torch.int64)
        prefix = torch.zeros(ROUNDS, len(edges), dtype=torch.int64)
        prefix[:, 1:] = torch.cumsum(weights, dim=1) % PRIME  # sums stay below 2**31 * cells < 2**63
        lower = torch.searchsorted(edges, starts[row])
        upper = torch.searchsorted(edges, ends[row])
        chunks_sum = chunks_sum * ((prefix[:, upper] - prefix[:, lower]) % PRIME) % PRIME
        tensor_sum = tensor_sum * prefix[:, -1] % PRIME
    return bool(torch.equal(chunks_sum.sum(dim=1) % PRIME, tensor_sum))


Region = tuple[str, int, int, int]


def check_regions(regions: list[Region], name: Callable[[int], str], where: str) -> None:
    """Refuse items that read overlapping bytes: ``regions`` are ``(file, offset, length, item)``,
    ``name(item)`` describes an item for the message. Two items starting at the same byte count as
    overlapping even when empty.

    Raises:
        InvalidInputError: naming ``where``, the file, both items and their bytes.
    """
    ordered = sorted(regions)
    for (file, offset, length, item), (prev_file, prev_offset, prev_length, prev_item) in zip(
        ordered[1:], ordered, strict=False
    ):
        if file == prev_file and (offset < prev_offset + prev_length or offset == prev_offset):
            raise InvalidInputError(
                f"{where}: {name(item)} reads bytes {offset}-{offset + length} of {file}, which overlap bytes "
                f"{prev_offset}-{prev_offset + prev_length} that {name(prev_item)} reads: a checkpoint stores each "
                "item once, and this one would reuse its bytes"
            )
