"""Keeping memory management from holding the GIL for long while large request bodies are handled.

Three things did, each stalling the event loop (every other request) for as long as it ran:

- **full garbage collections.** Parsing and validating a large JSON body creates objects
  faster than they die, and that sets off collections walking every live object: 60-100 ms at
  a time for a 16 MiB manifest. The trees a body becomes hold no reference cycles (reference
  counting frees them), so :func:`gc_paused` keeps the collector off while a large body is
  handled, and until its tree is gone.
- **freeing a large tree at once.** Dropping the last reference to a list of 60,000 models
  frees them all in one C call (130 ms for a 16 MiB manifest), often on the event loop, where
  FastAPI lets go of a route's arguments. :func:`release` takes such a tree apart a container
  at a time, from Python, so other threads run in between; :func:`release_later` waits for
  the other holders to let go first, so the tree is never freed on the event loop.
- **memory spread over many threads.** :func:`in_body_thread` keeps the work on two threads.

A pause never outlasts :data:`MAX_PAUSE_SECONDS` of continuous large bodies: the request that
ends a pause that long runs one collection itself, so garbage cycles made meanwhile by other
requests (exceptions and their tracebacks) cannot pile up under a steady load of large bodies.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel

T = TypeVar("T")

MAX_PAUSE_SECONDS = 30.0
#: Threads that parse, validate and free large request bodies (:func:`in_body_thread`).
BODY_THREADS = 2

_lock = threading.Lock()
_pausers = 0
_paused_at = 0.0
_was_enabled = True


def pause_gc() -> None:
    """Turn the cyclic garbage collector off until the matching :func:`resume_gc` (calls nest)."""
    global _pausers, _paused_at, _was_enabled
    with _lock:
        if _pausers == 0:
            _was_enabled = gc.isenabled()
            _paused_at = time.monotonic()
            gc.disable()
        _pausers += 1


def resume_gc() -> None:
    """End one :func:`pause_gc`; the last one turns the collector back on."""
    global _pausers, _paused_at
    collect = False
    with _lock:
        _pausers -= 1
        if _pausers == 0:
            if _was_enabled:
                gc.enable()
        elif time.monotonic() - _paused_at > MAX_PAUSE_SECONDS:
            _paused_at = time.monotonic()
            collect = _was_enabled
    if collect:
        gc.collect()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Keep the cyclic garbage collector off while the block runs (blocks may overlap, in any threads)."""
    pause_gc()
    try:
        yield
    finally:
        resume_gc()


def release(holder: list[Any]) -> None:
    """Free the objects in ``holder`` (emptied) piece by piece; meant for a worker thread.

    Lists, dicts and pydantic models that nothing else refers to are emptied before they are
    dropped, so each object is freed on its own instead of a whole tree in one go. Anything
    something else still holds (a cached manifest sharing entries, say) is left as it is.
    """
    stack = holder[:]
    holder.clear()
    while stack:
        item = stack.pop()
        # 2: ``item`` and getrefcount's argument. Anything more is a holder outside this tree.
        if sys.getrefcount(item) > 2:
            continue
        if type(item) is list:
            stack.extend(item)
            item.clear()
        elif type(item) is dict:
            stack.extend(item.values())
            item.clear()
        elif isinstance(item, BaseModel) and sys.getrefcount(item.__dict__) == 2:
            stack.extend(item.__dict__.values())
            item.__dict__.clear()


_releasing: set[asyncio.Task[None]] = set()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


async def in_body_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on one of the :data:`BODY_THREADS` threads kept for large bodies.

    Few and always the same threads: at most that many bodies are parsed at once (the others
    wait their turn), which bounds the memory they take together; and the memory one frees goes
    back to the allocator's arena of its thread, where the next body parsed there reuses it
    (spread over every worker thread, each arena kept its own and the process grew with each).
    """
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="ckptstore-body")
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(function, *args))


def release_later(value: Any, *, poll: float = 0.05, patience: float = 120.0) -> None:
    """Free ``value`` piece by piece on a worker thread, once nothing else refers to it.

    Call from the event loop with the last reference you hold. Other holders (a route's
    finished frames, kept by an exception on its way to the error handler; FastAPI's resolved
    arguments) let go of it on the event loop, where freeing it would stall every request;
    holding it until they have, then :func:`release` on a body thread, moves that work off it. After
    ``patience`` seconds it is released whatever still refers to it. Garbage collection stays
    paused (:func:`pause_gc`) until then.
    """
    loop = asyncio.get_running_loop()

    async def wait_then_release(holder: list[Any]) -> None:
        try:
            deadline = loop.time() + patience
            # 2: ``holder`` and getrefcount's argument.
            while sys.getrefcount(holder[0]) > 2 and loop.time() < deadline:
                await asyncio.sleep(poll)
            await in_body_thread(release, holder)
        finally:
            resume_gc()

    # Collections stay off until the tree is gone: one now would walk all of it.
    pause_gc()
    task = loop.create_task(wait_then_release([value]))
    del value
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)
