"""Where each member of a stored zip archive lies, checked before any member is read: inside the
archive, and every member a region of its own.

A zip's central directory lists each member with the offset of its local header; nothing in the
format stops two entries from naming one header, or one member's bytes from running over the
headers and bytes of others. A ``torch.save`` archive never does either, and an archive that does
makes one stretch of its bytes into many storages (16 MiB read as 400 tensors). So the region of a
member, from its local header to the end of its data, must not meet any other's: the regions are
sorted by where they start and each checked against the one before it (n log n; once the ones
before are disjoint, only the nearest can reach past a start).
"""

from __future__ import annotations

import mmap
import struct
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from ckptstore.client.formats import confined
from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.service.errors import InvalidInputError

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


@dataclass(frozen=True)
class Region:
    """A member's place in the archive: its local header at ``header_at``, its ``size`` bytes at ``data_at``."""

    name: str
    header_at: int
    data_at: int
    size: int

    @property
    def end(self) -> int:
        """Just past the member's last byte."""
        return self.data_at + self.size


def check_disjoint(where: str, regions: Iterable[Region]) -> None:
    """Refuse two regions that start at one local header or overlap in ``[header_at, end)``.

    Raises:
        InvalidInputError: naming ``where`` and the first two members at fault (by start).
    """
    ordered = sorted(regions, key=lambda r: (r.header_at, r.end))
    for before, after in pairwise(ordered):
        if after.header_at == before.header_at:
            raise InvalidInputError(
                f"{where}: archive members {shown(before.name, 80)} and {shown(after.name, 80)} share one local "
                f"header (at byte {after.header_at}): an archive that reuses its bytes, which torch.save never writes"
            )
        if after.header_at < before.end:
            raise InvalidInputError(
                f"{where}: archive members {shown(before.name, 80)} (bytes {before.header_at}-{before.end}) and "
                f"{shown(after.name, 80)} (from byte {after.header_at}) overlap: an archive that reuses its bytes, "
                "which torch.save never writes"
            )


def member_regions(
    where: str, members: list[zipfile.ZipInfo], mapped: mmap.mmap | bytes, start: int, length: int
) -> dict[str, Region]:
    """Each member's region in ``mapped[start:start + length]`` (offsets relative to ``start``), by name,
    from its local header; every region inside the archive and no two meeting (:func:`check_disjoint`).

    Raises:
        InvalidInputError: a local header missing or outside the archive, a member's bytes past its
            end, or two members that share or overlap.
    """
    regions: list[Region] = []
    for member in members:
        what = f"member {shown(member.filename, 80)}"
        header_at = member.header_offset
        confined.check_region(where, header_at, LOCAL_HEADER.size, length, what)
        fields = LOCAL_HEADER.unpack(bytes(mapped[start + header_at : start + header_at + LOCAL_HEADER.size]))
        if fields[0] != ZIP_MAGIC:
            raise InvalidInputError(f"{where}: archive {what} has no local header")
        data_at = header_at + LOCAL_HEADER.size + fields[10] + fields[11]
        confined.check_region(where, data_at, member.compress_size, length, what)
        regions.append(Region(member.filename, header_at, data_at, member.compress_size))
    check_disjoint(where, regions)
    return {region.name: region for region in regions}


__all__ = ["LOCAL_HEADER", "ZIP_MAGIC", "Region", "check_disjoint", "member_regions"]
