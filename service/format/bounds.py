"""The largest numbers the metadata database holds, shared by every check of a number from outside.

PostgreSQL's ``INTEGER`` holds 32-bit signed values and ``BIGINT`` 64-bit ones; SQLite holds
either in 64 bits. Every number a caller sends is checked against the bound of the column it
will be compared with or stored in, before any SQL runs, so both databases accept exactly the
same inputs and a number too large for a column is a 4xx naming it, never a driver error.
Which bound each integer column of :mod:`service.db.models` has is listed in
``tests/api/test_bounds.py``, which fails for a column left out.
"""

from __future__ import annotations

#: The largest value of an ``INTEGER`` column (version numbers, counts).
INT32_MAX = 2**31 - 1
#: The largest value of a ``BIGINT`` column (sizes, offsets, steps).
INT64_MAX = 2**63 - 1
#: The largest version number a run can have (``versions.version`` is an ``INTEGER``).
MAX_VERSION = INT32_MAX
#: The most distinct tensor sizes one call asks the store about (one index probe each).
MAX_SIZES_PER_QUERY = 1024

__all__ = ["INT32_MAX", "INT64_MAX", "MAX_SIZES_PER_QUERY", "MAX_VERSION"]
