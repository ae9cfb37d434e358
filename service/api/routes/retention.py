"""Routes for a run's retention policy: read it, replace it, apply it now.

Reading needs a read token. Replacing or applying a policy needs an admin token: a policy
deletes versions (at the next commit, or at once when applied), and deleting a version is an
admin operation (``DELETE /v1/runs/{run_id}/versions/{ref}``). Commits with a write token still
apply the policy an admin set.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from starlette.concurrency import run_in_threadpool

from ckptstore.service.api.deps import CanAdmin, CanRead, StoreDep
from ckptstore.service.api.http.strict_json import StrictJSONRoute
from ckptstore.service.api.schemas import RemovedVersions, RetentionRequest
from ckptstore.service.format.records import RetentionPolicy

router = APIRouter(prefix="/v1/runs", route_class=StrictJSONRoute, tags=["retention"])
RunId = Annotated[str, Path(max_length=128, description="A run id.")]


@router.get("/{run_id}/retention", dependencies=[CanRead])
async def get_retention(run_id: RunId, store: StoreDep) -> RetentionPolicy:
    """The run's retention policy and the versions it would remove now."""
    return await run_in_threadpool(store.get_retention, run_id)


@router.put("/{run_id}/retention", dependencies=[CanAdmin])
async def put_retention(
    run_id: RunId,
    body: RetentionRequest,
    store: StoreDep,
    create: Annotated[bool, Query(description="Create the run if it does not exist yet (else 404).")] = False,
) -> RetentionPolicy:
    """Replace the run's policy; it applies from the next commit. An unknown run is 404 unless ``create``."""
    return await run_in_threadpool(
        lambda: store.set_retention(
            run_id,
            keep_last=body.keep_last,
            keep_best=body.keep_best,
            metric=body.metric,
            mode=body.mode,
            create_run=create,
        )
    )


@router.post("/{run_id}/retention/apply", dependencies=[CanAdmin])
async def apply_retention(run_id: RunId, store: StoreDep) -> RemovedVersions:
    """Remove now the versions the run's policy does not keep."""
    removed = await run_in_threadpool(store.apply_retention, run_id)
    return RemovedVersions(run_id=run_id, removed=removed)
