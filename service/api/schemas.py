"""Request bodies of the API (responses reuse service.records and the manifest models)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.format.manifest import Digest, ManifestBody
from service.format.names import TagName

MAX_DIGESTS = 100_000
Ref = Annotated[str, StringConstraints(max_length=64)] | Annotated[int, Field(ge=1, le=2**63 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DigestList(_Strict):
    """A list of tensor digests."""

    digests: Annotated[list[Digest], Field(max_length=MAX_DIGESTS)]


class MissingResponse(BaseModel):
    """The digests the store lacks."""

    missing: list[str]


class CommitRequest(_Strict):
    """A version to commit: its manifest body and the tags to point at it."""

    manifest: ManifestBody
    tags: Annotated[list[TagName], Field(max_length=32)] = Field(default_factory=list)


class TagRequest(_Strict):
    """Which version a tag should point at: a number, 'latest' or another tag."""

    version: Ref


class ResolvedVersion(BaseModel):
    """The version number a reference resolved to."""

    run_id: str
    version: int


class ErrorBody(BaseModel):
    """Every error response: a stable code and a message naming the problem and the fix."""

    code: str
    message: str
    digests: list[str] | None = None
