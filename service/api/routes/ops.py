"""Operational routes: health and metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from ckptstore.service import __version__
from ckptstore.service.api.deps import MetricsDep, StoreDep, StreamerDep

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def health(store: StoreDep) -> dict[str, str]:
    """200 when the metadata database answers (503 otherwise)."""
    await run_in_threadpool(store.ping)
    return {"status": "ok", "version": __version__}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(counters: MetricsDep, streamer: StreamerDep) -> str:
    """Request and byte counters, and the bytes of answers not yet taken, in the Prometheus text format."""
    return counters.render(streamer.budget.held)
