"""A long run of the layout round trips: thousands of drawn tensors on every backend.

    .venv/bin/python tests/layouts_long.py [EXAMPLES] [SEED]

CI runs the same tests with a bounded count and a fixed seed; this draws more examples, with a
new seed each run unless one is given (the seed is printed, so a failure can be replayed).
"""

from __future__ import annotations

import os
import random
import sys

import pytest


def main() -> int:
    """Run tests/client/test_layouts.py with many examples; returns pytest's exit code."""
    examples = sys.argv[1] if len(sys.argv) > 1 else "2000"
    seed = sys.argv[2] if len(sys.argv) > 2 else str(random.randrange(2**32))
    os.environ["CKPTSTORE_LAYOUT_EXAMPLES"] = examples
    os.environ["CKPTSTORE_LAYOUT_SEED"] = seed
    print(f"layout round trips: {examples} examples per backend, seed {seed}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    return pytest.main([os.path.join(here, "client", "test_layouts.py"), "-q", "-p", "no:cacheprovider"])


if __name__ == "__main__":
    sys.exit(main())
