"""The receive low-water mark of sockets large bodies are read from (service.receive_mark), on
real loopback sockets."""

from __future__ import annotations

import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.service.receive_mark import LOW_WATER, MARKS, ReceiveMark, low_water


@settings(max_examples=200, deadline=None)
@given(left=st.integers(1, 1 << 40), data=st.data())
def test_the_mark_never_waits_for_more_than_is_still_to_come(left: int, data: st.DataObject) -> None:
    want = data.draw(st.integers(1, left))
    mark = low_water(left, want)
    assert 1 <= mark <= max(1, left - want)  # the bytes still to come after this receive reach it
    assert mark == (LOW_WATER if left - want >= LOW_WATER else 1)


@settings(max_examples=25, deadline=None)
@given(receives=st.lists(st.tuples(st.integers(1, 8 * LOW_WATER), st.integers(1, 4 * LOW_WATER)), max_size=6))
def test_the_socket_holds_the_mark_of_each_receive_and_one_after(receives: list[tuple[int, int]]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sock:
        mark = ReceiveMark(sock)
        for left, want in receives:
            want = min(want, left)
            mark.before(left, want)
            expected = low_water(left, want) if MARKS else 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == expected
        mark.reset()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
