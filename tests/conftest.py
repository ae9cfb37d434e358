"""Shared test settings: no progress bars, no writes to the user's real store."""

from __future__ import annotations

import os

os.environ.setdefault("CKPTSTORE_DISABLE_PROGRESS_BARS", "1")
