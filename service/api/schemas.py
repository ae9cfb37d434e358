"""Request bodies of the API (responses reuse service.format.records and the manifest models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from ckptstore.service.api.http.range_batch import MAX_BATCH_BYTES, MAX_RANGES
from ckptstore.service.catalog.retention_rules import MAX_KEEP
from ckptstore.service.format.bounds import INT64_MAX, MAX_VERSION
from ckptstore.service.format.manifest import Digest, ManifestBody, few_body_fields, few_unknown_fields
from ckptstore.service.format.names import MetricName, TagName
from ckptstore.service.format.sharding import MAX_SIZES_PER_REQUEST
from ckptstore.service.reclaim.gc import MAX_GRACE_SECONDS

MAX_DIGESTS = 100_000
Ref = Annotated[str, StringConstraints(max_length=64)] | Annotated[int, Field(ge=1, le=MAX_VERSION)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        return few_unknown_fields(cls, data)


class DigestList(_Strict):
    """A list of tensor digests."""

    digests: Annotated[list[Digest], Field(max_length=MAX_DIGESTS, fail_fast=True)]


#: Most sizes one ``POST /v1/tensors/sizes`` may ask about (a save asks about each size it has once).
MAX_SIZES = MAX_SIZES_PER_REQUEST


class SizeList(_Strict):
    """Tensor sizes in bytes."""

    sizes: Annotated[list[Annotated[int, Field(ge=1, le=1 << 62)]], Field(max_length=MAX_SIZES, fail_fast=True)]


class SizesHeld(BaseModel):
    """Those of the sizes asked about that some stored tensor has, and whether shard bytes go to
    the blob store directly (then a client hashes its tensors and asks for upload URLs; otherwise
    it may send new tensors unhashed with ``POST /v1/shards``)."""

    held: list[int]
    direct_uploads: bool


#: Most shards one ``POST /v1/shards/urls`` may ask about (a version's shards, a few at a time).
MAX_URL_SHARDS = 1024


class ShardList(_Strict):
    """A list of shard ids."""

    shards: Annotated[list[Digest], Field(max_length=MAX_URL_SHARDS, fail_fast=True)]


class ReadUrls(_Strict):
    """Signed URLs clients GET shard bytes from directly, valid for ``expires_in`` seconds;
    ``urls`` is empty where the server has none to give (reads then go through it)."""

    urls: dict[str, str]
    expires_in: int


class ShardRange(_Strict):
    """``length`` bytes of shard ``shard_id`` from byte ``offset``."""

    shard_id: Digest
    offset: Annotated[int, Field(ge=0, le=INT64_MAX)]
    length: Annotated[int, Field(ge=1, le=MAX_BATCH_BYTES)]


class RangeBatch(_Strict):
    """Byte ranges of shards to answer back to back, in this order."""

    ranges: Annotated[list[ShardRange], Field(min_length=1, max_length=MAX_RANGES, fail_fast=True)]


class MissingResponse(BaseModel):
    """The digests the store lacks."""

    missing: list[str]


class CommitRequest(_Strict):
    """A version to commit: its manifest body and the tags to point at it."""

    manifest: ManifestBody
    tags: Annotated[list[TagName], Field(max_length=32)] = Field(default_factory=list)

    @field_validator("manifest", mode="before")
    @classmethod
    def _few_unknown_manifest_fields(cls, data: Any) -> Any:
        return few_body_fields(data)


class TagRequest(_Strict):
    """Which version a tag should point at: a number, 'latest' or another tag."""

    version: Ref


class ResolvedVersion(BaseModel):
    """The version number a reference resolved to."""

    run_id: str
    version: int


class RetentionRequest(_Strict):
    """A run's new retention policy; leaving out both keep_last and keep_best clears it.

    ``mode`` ('min': lower is better, the default; 'max') and ``metric`` go with ``keep_best``.
    """

    keep_last: Annotated[int, Field(ge=1, le=MAX_KEEP)] | None = None
    keep_best: Annotated[int, Field(ge=1, le=MAX_KEEP)] | None = None
    metric: MetricName | None = None
    mode: Literal["min", "max"] | None = None


class RemovedVersions(BaseModel):
    """The versions a request removed."""

    run_id: str
    removed: list[int]


class GcRequest(_Strict):
    """A garbage collection: report only (``dry_run``), the grace period (default one hour), and
    whether to also delete blobs no shard row names and the staging folders' temporary files no
    live process holds (``orphans``), the live share below which a
    shard is compacted (``compact_below``, none by default), and whether to first compress the
    tensors of versions older than the grace period (``compress``)."""

    dry_run: bool = False
    grace_seconds: Annotated[int, Field(ge=0, le=MAX_GRACE_SECONDS)] | None = None
    orphans: bool = False
    compact_below: Annotated[float, Field(gt=0, le=1)] | None = None
    compress: bool = False


class ErrorBody(BaseModel):
    """Every error response: a stable code and a message naming the problem and the fix."""

    code: str
    message: str
    digests: list[str] | None = None
