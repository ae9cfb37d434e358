"""Hostile imports of the second probe: each piece valid, the whole unbounded or the check itself the attack.

- aliasing and amplification: many DCP chunks or byte entries reading one stored item; many tensors
  over one storage, each cloned; zip entries sharing one local header or overlapping regions;
- work before the bounds are known: a value formatted, hashed or compared while it is still being read;
- checks that are the attack: quadratic overlap sweeps, caps that read a spelling;
- escapes: control sequences in names shown on the terminal;
- races: a folder changed during the import.

Every case here is refused within 10 s and 500 MiB peak RSS (:data:`tests.cli.hostile_case.WITHIN_S`,
:data:`tests.cli.hostile_case.MAX_RSS_MIB`), in its own process.
"""

from __future__ import annotations

from tests.cli import hostile_dcp_reuse, hostile_pt_reuse, hostile_walkarounds
from tests.cli.hostile_case import Case

CASES: list[Case] = [*hostile_dcp_reuse.CASES, *hostile_pt_reuse.CASES, *hostile_walkarounds.CASES]
