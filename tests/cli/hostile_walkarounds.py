"""Caps that read a spelling (safetensors entry counts, config fields that size a model), control sequences in
names shown on the terminal, and folders changed during the import.

Each case is refused in its own process within :data:`~tests.cli.hostile_case.WITHIN_S` seconds and
:data:`~tests.cli.hostile_case.MAX_RSS_MIB` MiB peak RSS (``isolated=True, within_s=WITHIN_S,
max_rss_mib=MAX_RSS_MIB``).
"""

from __future__ import annotations

from tests.cli.hostile_case import Case

CASES: list[Case] = []
