"""Routes for runs, versions, manifests and tags."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ckptstore.service.api.deps import CanAdmin, CanRead, CanWrite, StoreDep
from ckptstore.service.api.http.strict_json import StrictJSONRoute
from ckptstore.service.api.schemas import CommitRequest, ResolvedVersion, TagRequest
from ckptstore.service.format.manifest import Manifest, manifest_to_json
from ckptstore.service.format.records import MetadataProblem, RunInfo, VersionInfo

router = APIRouter(prefix="/v1/runs", route_class=StrictJSONRoute, tags=["runs"])
RunId = Annotated[str, Path(max_length=128, description="A run id.")]
Ref = Annotated[str, Path(max_length=64, description="A version number, 'latest' or a tag.")]
TagPath = Annotated[str, Path(max_length=64, description="A tag name.")]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=64,
        description="Names this commit (16-64 characters from A-Z a-z 0-9 _ -, such as a UUID's hex): "
        "sent again with the same key, the commit answers with the version it made the first time.",
    ),
]


@router.get("", dependencies=[CanRead])
async def list_runs(store: StoreDep) -> list[RunInfo]:
    """Every run, most recently updated first."""
    return await run_in_threadpool(store.runs)


@router.get("/{run_id}/versions", dependencies=[CanRead])
async def list_versions(run_id: RunId, store: StoreDep) -> list[VersionInfo]:
    """Every version of a run, oldest first."""
    return await run_in_threadpool(store.versions, run_id)


@router.post("/{run_id}/versions", dependencies=[CanWrite], status_code=201)
async def commit_version(
    run_id: RunId, body: CommitRequest, store: StoreDep, idempotency_key: IdempotencyKey = None
) -> VersionInfo:
    """Commit a version whose tensors are all stored; 409 lists any that are missing.

    With an ``Idempotency-Key``, a commit sent again (its answer was lost) answers with the
    version the key committed, and commits nothing more."""
    return await run_in_threadpool(
        lambda: store.commit(run_id, body.manifest, tags=body.tags, commit_key=idempotency_key)
    )


@router.get(
    "/{run_id}/versions/{ref}",
    dependencies=[CanRead],
    response_class=Response,
    responses={200: {"content": {"application/json": {"schema": Manifest.model_json_schema()}}}},
)
async def get_manifest(run_id: RunId, ref: Ref, store: StoreDep) -> Response:
    """The manifest of a version (``ref`` = number, 'latest' or tag)."""
    manifest = await run_in_threadpool(store.manifest, run_id, ref)
    return Response(manifest_to_json(manifest), media_type="application/json")


@router.get("/{run_id}/versions/{ref}/metadata-check", dependencies=[CanRead])
async def check_metadata(run_id: RunId, ref: Ref, store: StoreDep) -> list[MetadataProblem]:
    """What differs in a version's stored metadata from the digests covering it (empty: nothing)."""
    return await run_in_threadpool(store.check_metadata, run_id, ref)


@router.delete("/{run_id}/versions/{ref}", dependencies=[CanAdmin])
async def delete_version(run_id: RunId, ref: Ref, store: StoreDep) -> ResolvedVersion:
    """Delete a version; its bytes are reclaimed later by garbage collection."""
    version = await run_in_threadpool(store.delete_version, run_id, ref)
    return ResolvedVersion(run_id=run_id, version=version)


@router.get("/{run_id}/refs/{ref}", dependencies=[CanRead])
async def resolve_ref(run_id: RunId, ref: Ref, store: StoreDep) -> ResolvedVersion:
    """The version number a reference names."""
    return ResolvedVersion(run_id=run_id, version=await run_in_threadpool(store.resolve, run_id, ref))


@router.put("/{run_id}/tags/{name}", dependencies=[CanWrite])
async def put_tag(run_id: RunId, name: TagPath, body: TagRequest, store: StoreDep) -> ResolvedVersion:
    """Point a tag at a version (moving it if it exists)."""
    version = await run_in_threadpool(store.tag, run_id, body.version, name)
    return ResolvedVersion(run_id=run_id, version=version)


@router.delete("/{run_id}/tags/{name}", dependencies=[CanWrite], status_code=204)
async def delete_tag(run_id: RunId, name: TagPath, store: StoreDep) -> Response:
    """Remove a tag."""
    await run_in_threadpool(store.untag, run_id, name)
    return Response(status_code=204)
