"""The manifest: a JSON document describing one complete checkpoint version.

``ManifestBody`` is what a client sends to commit; the store adds the run id, version
number, parent and creation time to make the stored, immutable ``Manifest``. Every model is
strict: unknown fields, wrong types ("1" or 1.0 for an int), NaN/Infinity and oversized
integers are rejected; only a metric may be NaN or infinite, written as the string "NaN",
"Infinity" or "-Infinity" (:data:`service.format.names.MetricValue`).
``docs/manifest.schema.json`` is generated from these classes.
"""

from __future__ import annotations

import functools
import json
import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, ValidationError, model_validator

from ckptstore.service.errors import InvalidManifestError
from ckptstore.service.format.bounds import INT64_MAX
from ckptstore.service.format.digest import DIGEST_PATTERN
from ckptstore.service.format.dtypes import DTYPES, byte_length, element_count, shape_problem
from ckptstore.service.format.names import MetricName, MetricValue, RunId

FORMAT_VERSION = "ckptstore.manifest/1"
TENSOR_REF = "__tensor__"
MAX_TENSORS = 1_000_000
MAX_CHUNKS = 4096
MAX_JSON_DEPTH = 64
MAX_UNKNOWN_FIELDS = 8

Digest = Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]
Dim = Annotated[int, Field(ge=0, le=INT64_MAX)]
Shape = Annotated[list[Dim], Field(max_length=64)]
#: A tensor's own shape: its dims are bounded together, by the entry (``shape_problem``), so a
#: refusal names the tensor; the schema states the bound on each dim that this implies.
TensorShape = Annotated[
    list[Annotated[int, Field(ge=0, json_schema_extra={"maximum": INT64_MAX})]],
    Field(
        max_length=64,
        description="The product of the dims (a 0 counted as 1) times the dtype's item size is below 2**63: "
        "the tensor's size in elements and bytes and each of its strides fit 64-bit integers.",
    ),
]
TensorKey = Annotated[
    str, StringConstraints(pattern=r"^(model|optim|scheduler|extra|resume)/[^\x00-\x1f\x7f]{1,1000}$")
]
ParamName = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,1000}$")]
DeviceType = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
DTypeName = Literal[
    "BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
    "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F16", "BF16", "F32", "F64", "C64",
]  # fmt: skip
Placement = Literal["param", "host", "target"]
StateSection = Literal["optim", "scheduler", "extra", "dcp", "resume"]
ShortText = Annotated[str, StringConstraints(max_length=200)]
#: A class by its module and qualified name (``torch.optim.adamw.AdamW``; a class made in a function
#: has ``<locals>`` in its qualified name).
QualifiedName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.<>]{0,199}$")]


@functools.cache
def _field_limit(model: type[BaseModel]) -> int:
    # Reading ``model_fields`` costs about 0.4 us, 0.4 ms for a body of a thousand entries.
    return len(model.model_fields) + MAX_UNKNOWN_FIELDS


def few_unknown_fields(model: type[BaseModel], data: Any) -> Any:
    """A before-validator body for ``extra="forbid"`` models: refuse many unknown fields with one error.

    ``extra="forbid"`` reports every unknown field as an error of its own, so an object with a
    million of them would take seconds and gigabytes to describe; past a few, one error will do.
    """
    if isinstance(data, dict) and len(data) > _field_limit(model):
        unknown = [str(key)[:40] for key in data if key not in model.model_fields]
        raise ValueError(f"{len(unknown)} unknown fields, e.g. {', '.join(map(repr, unknown[:3]))}")
    return data


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class Chunk(_Strict):
    """A piece of a tensor: where it sits in the global shape and the digest of its bytes."""

    offsets: Shape
    shape: Shape
    digest: Digest


class TensorEntry(_Strict):
    """One tensor of a checkpoint.

    ``placement`` says where load puts it: ``param`` = the device of parameter ``param``,
    ``host`` = always the CPU, ``target`` = the device asked for at load time.
    A tensor is stored whole (``digest``) or as ``chunks`` tiling its shape, never both.
    """

    key: TensorKey
    dtype: DTypeName
    shape: TensorShape
    dtype_class: Literal["floating", "integer", "bool", "complex"]
    digest: Digest | None = None
    chunks: Annotated[list[Chunk], Field(min_length=1, max_length=MAX_CHUNKS)] | None = None
    placement: Placement
    param: ParamName | None = None
    device_type: DeviceType
    trainable: bool | None = None
    #: A model parameter's ``requires_grad``, where the save knew it (see FORMAT.md); absent otherwise.
    requires_grad: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        size, kind = DTYPES[self.dtype]
        if self.dtype_class != kind:
            raise ValueError(f"{self.key}: dtype_class {self.dtype_class} does not match dtype {self.dtype}")
        if (self.digest is None) == (self.chunks is None):
            raise ValueError(f"{self.key}: give exactly one of digest and chunks")
        # A load of many small tensors validates one entry each: the common shape is checked here.
        if 0 in self.shape or size * math.prod(self.shape) > INT64_MAX:
            problem = shape_problem(self.dtype, self.shape)
            if problem is not None:
                raise ValueError(f"{self.key}: {problem}")
        if (self.placement == "param") != (self.param is not None):
            raise ValueError(f"{self.key}: 'param' is required with placement 'param' and only then")
        if self.key.startswith("model/") != (self.trainable is not None):
            raise ValueError(f"{self.key}: 'trainable' is required for model tensors and only for them")
        if self.requires_grad is not None and not self.key.startswith("model/"):
            raise ValueError(f"{self.key}: 'requires_grad' is for model tensors only")
        if self.chunks is not None:
            _check_tiling(self.key, self.shape, self.chunks)
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return byte_length(self.dtype, self.shape)

    def digests(self) -> list[str]:
        """Every stored piece's digest (one unless chunked)."""
        return [self.digest] if self.digest is not None else [c.digest for c in self.chunks or ()]


def _check_tiling(key: str, shape: list[int], chunks: list[Chunk]) -> None:
    boxes = []
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.shape) != len(shape):
            raise ValueError(f"{key}: a chunk's offsets and shape must have {len(shape)} dimensions")
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.shape, shape, strict=True)):
            raise ValueError(f"{key}: chunk at {chunk.offsets} reaches outside shape {shape}")
        if element_count(chunk.shape) == 0 and element_count(shape) > 0:
            raise ValueError(f"{key}: chunk at {chunk.offsets} is empty")
        boxes.append([(o, o + s) for o, s in zip(chunk.offsets, chunk.shape, strict=True)])
    if sum(element_count(c.shape) for c in chunks) != element_count(shape):
        raise ValueError(f"{key}: chunks do not cover shape {shape} exactly")
    # Sweep along the most-split dimension: only chunks whose ranges meet there can overlap,
    # which keeps grid-like tilings (what sharded saves produce) near-linear.
    if not shape:
        if len(chunks) > 1:
            raise ValueError(f"{key}: a scalar has more than one chunk")
        return
    axis = max(range(len(shape)), key=lambda d: len({box[d][0] for box in boxes}))
    boxes.sort(key=lambda box: box[axis])
    active: list[list[tuple[int, int]]] = []
    for box in boxes:
        active = [other for other in active if other[axis][1] > box[axis][0]]
        for other in active:
            if all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(box, other, strict=True)):
                raise ValueError(f"{key}: two chunks overlap")
        active.append(box)


class ManifestBody(_Strict):
    """What a client commits: every tensor, the JSON state tree, step and metrics."""

    format: Literal["ckptstore.manifest/1"] = "ckptstore.manifest/1"
    digest_algorithm: Literal["blake3"] = "blake3"
    # fail_fast: stop at the first bad item, so a million bad entries cost one error, not a million.
    tensors: Annotated[list[TensorEntry], Field(max_length=MAX_TENSORS, fail_fast=True)]
    state: Annotated[dict[StateSection, JsonValue], Field(fail_fast=True)] = Field(default_factory=dict)
    step: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    #: Any float, NaN and the infinities included, which JSON writes as "NaN", "Infinity", "-Infinity".
    metrics: Annotated[dict[MetricName, MetricValue], Field(max_length=256, fail_fast=True)] = Field(
        default_factory=dict
    )
    library: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], ShortText], Field(max_length=32, fail_fast=True)
    ] = Field(default_factory=dict)
    optimizer_class: QualifiedName | None = Field(
        default=None,
        description="The class of the optimizer whose state state.optim holds (module and qualified name), "
        "where the save knew it; a strict load into an optimizer of another class is refused.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ManifestBody:
        keys: set[str] = set()
        for entry in self.tensors:
            if entry.key in keys:
                raise ValueError(f"tensor key {entry.key!r} appears twice")
            keys.add(entry.key)
        for section, tree in self.state.items():
            for ref in _check_json_tree(tree, section, 0):
                if ref not in keys:
                    raise ValueError(f"state/{section} refers to tensor {ref!r}, which the manifest does not list")
        return self

    def digests(self) -> set[str]:
        """Every digest the manifest references."""
        return {d for entry in self.tensors for d in entry.digests()}


def _check_json_tree(value: Any, path: str, depth: int) -> list[str]:
    """Reject deep nesting, non-finite floats and out-of-range ints; return tensor references."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int):
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ValueError(f"{path}: integer {value} does not fit in 64 bits")
        return []
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number")
        return []
    refs: list[str] = []
    if isinstance(value, list):
        for index, item in enumerate(value):
            refs += _check_json_tree(item, f"{path}/{index}", depth + 1)
        return refs
    if isinstance(value, dict):
        # len() first: set(value) of an object with a million keys holds the GIL for 100 ms.
        if len(value) == 1 and isinstance(value.get(TENSOR_REF), str):
            return [value[TENSOR_REF]]
        for name, item in value.items():
            refs += _check_json_tree(item, f"{path}/{name}", depth + 1)
        return refs
    raise ValueError(f"{path}: {type(value).__name__} is not a JSON value")


class Manifest(ManifestBody):
    """A committed, immutable version: the body plus its identity in the store."""

    run_id: RunId
    version: Annotated[int, Field(ge=1, le=INT64_MAX)]
    parent: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    created_at: datetime


def stamp(body: ManifestBody, *, run_id: str, version: int, parent: int | None, created_at: datetime) -> Manifest:
    """The stored manifest of an already validated ``body`` with its identity in the store.

    The body's fields are taken as they are, not validated again: checking every entry of a
    large manifest twice is most of the cost of committing a small change to it. The identity
    comes from the store (a validated run id, the run's next version number, its newest
    version and the commit time), so the result is what validating the whole would give.
    """
    return Manifest.model_construct(
        **{name: getattr(body, name) for name in ManifestBody.model_fields},
        run_id=run_id,
        version=version,
        parent=parent,
        created_at=created_at,
    )


def _raise_invalid(exc: ValidationError, what: str) -> InvalidManifestError:
    problems = "; ".join(
        f"{'/'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()[:10]
    )
    return InvalidManifestError(f"invalid {what}: {problems}")


def few_body_fields(data: Any) -> Any:
    """Refuse, with one error, a manifest body, entry or chunk with many unknown fields.

    Meant for untrusted bodies before validation (a model validator would also run on stored
    manifests, and in JSON mode it would make strict validation refuse their datetimes).
    """
    few_unknown_fields(ManifestBody, data)
    tensors = data.get("tensors") if isinstance(data, dict) else None
    for entry in tensors if isinstance(tensors, list) else ():
        few_unknown_fields(TensorEntry, entry)
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        for chunk in chunks if isinstance(chunks, list) else ():
            few_unknown_fields(Chunk, chunk)
    return data


def validate_body(data: Any) -> ManifestBody:
    """Validate a parsed JSON object as a ManifestBody, raising InvalidManifestError."""
    try:
        few_body_fields(data)
    except ValueError as exc:
        raise InvalidManifestError(f"invalid manifest: {exc}") from exc
    try:
        return ManifestBody.model_validate(data, strict=True)
    except ValidationError as exc:
        raise _raise_invalid(exc, "manifest") from exc


def manifest_from_json(text: str | bytes) -> Manifest:
    """Parse a stored manifest's JSON text."""
    try:
        return Manifest.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise _raise_invalid(exc, "stored manifest") from exc


def manifest_to_json(manifest: Manifest) -> str:
    """Serialize a manifest compactly, leaving out absent optional fields."""
    return manifest.model_dump_json(exclude_none=True)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a stored manifest (written to docs/manifest.schema.json)."""
    schema = Manifest.model_json_schema()
    schema["$id"] = "https://ckptstore.invalid/schemas/manifest-1.json"
    schema["title"] = FORMAT_VERSION
    return schema


def schema_text() -> str:
    """The JSON Schema as the text stored in the docs folder."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
