"""tune_malloc: multi-MiB buffers freed and allocated again reuse memory instead of faulting it in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two subprocesses that churn multi-MiB buffers

# Four 4 MiB buffers alive at once (a download's pieces in flight), freed, allocated again:
# how many pages the kernel had to fault in over the rounds after the first.
# The default case imports nothing: importing the whole API frees blocks large enough that glibc
# raises its mmap threshold on its own, and the comparison would no longer be with the default.
CHURN = """
import json, resource, sys
tuned = None
if sys.argv[1] == "tuned":
    from ckptstore.service.api.server import tune_malloc
    tuned = tune_malloc()
def churn():
    pieces = [bytearray(4 << 20) for _ in range(4)]
    del pieces
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    churn()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


def test_tuned_malloc_reuses_freed_buffers_where_the_default_faults_them_in_again() -> None:
    default, tuned = faults("default"), faults("tuned")
    assert tuned["tuned"] is True  # glibc took both settings
    pages_per_round = 4 * (4 << 20) // 4096
    assert default["faults"] > 10 * pages_per_round  # the default gives the freed memory back every round
    assert tuned["faults"] < pages_per_round  # tuned: the memory of round one is reused
