"""A transport's ``put_tensors`` that holds large tensors' shards until a small tensors' shard is in."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

#: A waiting shard fails after this long, so a save that never sends a small shard first fails the test.
WAIT_SECONDS = 20


class SmallShardFirst:
    """Wraps ``real`` (a transport's unbound ``put_tensors``): a shard of tensors of ``small_below``
    bytes or more waits until a shard of smaller ones was taken, and fails after
    :data:`WAIT_SECONDS`. With one upload in flight, a save gets through only if its small
    tensors' shard goes beside the large ones. :attr:`sent` lists each shard's kind in the order
    the calls came."""

    def __init__(self, real: Callable[..., Any], small_below: int) -> None:
        self.real = real
        self.small_below = small_below
        self.sent: list[str] = []
        self._small_taken = threading.Event()

    def __get__(self, transport: Any, owner: type | None = None) -> Callable[..., Any]:
        """Set on a class as its ``put_tensors``, bound to each instance as a method is."""
        return functools.partial(self.__call__, transport)

    def __call__(self, transport: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        """``put_tensors`` of ``transport``, held as the class says."""
        small = all(tensor.data.nbytes < self.small_below for tensor in tensors)
        self.sent.append("small" if small else "large")
        if not small and not self._small_taken.wait(timeout=WAIT_SECONDS):
            raise AssertionError("a large tensors' shard went first and held the only upload turn")
        answer = self.real(transport, tensors, *args, **kwargs)
        if small:
            self._small_taken.set()
        return answer
