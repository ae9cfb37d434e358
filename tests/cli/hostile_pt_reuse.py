"""``torch.save`` files whose tensors clone one storage many times, whose zip entries share or overlap regions,
whose pickles make work before they are bounded, or whose storage keys are malformed.

Each case is refused in its own process within :data:`~tests.cli.hostile_case.WITHIN_S` seconds and
:data:`~tests.cli.hostile_case.MAX_RSS_MIB` MiB peak RSS (``isolated=True, within_s=WITHIN_S,
max_rss_mib=MAX_RSS_MIB``).
"""

from __future__ import annotations

from tests.cli.hostile_case import Case

CASES: list[Case] = []
