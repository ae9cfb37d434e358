"""The receive low-water mark of a socket a large body is read from with ``MSG_WAITALL``.

A blocking receive into a large buffer is woken each time a TCP segment lands (64 KiB over
loopback): thousands of wakeups, each a trip through the scheduler, for 512 MiB. With
``SO_RCVLOWAT`` at :data:`LOW_WATER` the kernel wakes the reader once that many bytes wait.
Measured on a 2-core VM, 512 MiB over loopback into 4 MiB buffers: the receiving thread woke
2,230-2,270 times without the mark and 280-380 times with it, and the transfer took 0.23-0.26 s
against 0.17-0.24 s. The server sets it while it takes an upload's body, the client while it
reads a download's (:class:`ReceiveMark`).

A mark above what is still to come could leave the last receive waiting out its timeout for
bytes that never come (a kernel wakes the reader only once the mark's bytes wait, or the
sender closes): :func:`low_water` keeps the mark at 1 for a receive that leaves fewer than
:data:`LOW_WATER` bytes of the body after it. Torch-free and import-cheap.
"""

from __future__ import annotations

import socket
import sys

#: The mark while a body has at least this many bytes left after the receive at hand.
LOW_WATER = 1 << 20
#: Whether this system's TCP takes a receive low-water mark that way (Linux).
MARKS = sys.platform == "linux" and hasattr(socket, "SO_RCVLOWAT")


def low_water(left: int, want: int) -> int:
    """The receive low-water mark for a receive of ``want`` of the ``left`` bytes a body has left:
    :data:`LOW_WATER` while at least that many remain after this receive, else 1."""
    return LOW_WATER if left - want >= LOW_WATER else 1


class ReceiveMark:
    """A socket's receive low-water mark, set only where it changes (it starts at the kernel's 1)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._mark = 1

    def before(self, left: int, want: int) -> None:
        """Set the mark for a receive of ``want`` of the ``left`` bytes the body has left."""
        self._set(low_water(left, want))

    def reset(self) -> None:
        """Put the mark back to 1, as the socket's next reader expects it."""
        self._set(1)

    def _set(self, mark: int) -> None:
        if MARKS and mark != self._mark:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self._mark = mark
