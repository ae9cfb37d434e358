"""Store-wide administration: garbage collection.

Collection needs an admin token: it deletes bytes (only those no committed version references,
but a dry run already lists what every run has deleted).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from starlette.concurrency import run_in_threadpool

from ckptstore.service.api.deps import CanAdmin, StoreDep
from ckptstore.service.api.http.strict_json import StrictJSONRoute
from ckptstore.service.api.schemas import GcRequest
from ckptstore.service.format.records import GcReport

router = APIRouter(prefix="/v1", route_class=StrictJSONRoute, tags=["admin"])
NO_OPTIONS = GcRequest()


@router.post("/gc", dependencies=[CanAdmin])
async def collect_garbage(store: StoreDep, body: Annotated[GcRequest, Body()] = NO_OPTIONS) -> GcReport:
    """Sweep shards no committed version references, sparing those within the grace period.

    Every field has a default, so the body may be left out.
    """
    return await run_in_threadpool(
        lambda: store.gc(
            grace_seconds=body.grace_seconds,
            dry_run=body.dry_run,
            orphans=body.orphans,
            compact_below=body.compact_below,
            compress=body.compress,
        )
    )
