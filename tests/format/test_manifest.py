"""The manifest: strict models, a frozen JSON form, and a schema file kept in step with the code."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckptstore.service.errors import InvalidManifestError
from ckptstore.service.format.manifest import (
    FORMAT_VERSION,
    MAX_JSON_DEPTH,
    Chunk,
    Manifest,
    ManifestBody,
    TensorEntry,
    json_schema,
    manifest_from_json,
    manifest_to_json,
    schema_text,
    stamp,
    validate_body,
)

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json"
D1, D2, D3, D4, D5, D6 = (c * 64 for c in "abcdef")
CREATED = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def model_entry(**changes: Any) -> dict[str, Any]:
    entry = {
        "key": "model/layer.weight",
        "dtype": "F32",
        "shape": [2, 3],
        "dtype_class": "floating",
        "digest": D1,
        "placement": "param",
        "param": "layer.weight",
        "device_type": "cpu",
        "trainable": True,
    }
    return entry | changes


def optim_entry(**changes: Any) -> dict[str, Any]:
    entry = {
        "key": "optim/state/0/exp_avg",
        "dtype": "F32",
        "shape": [2, 3],
        "dtype_class": "floating",
        "digest": D2,
        "placement": "param",
        "param": "layer.weight",
        "device_type": "cuda",
    }
    return entry | changes


def chunk(offsets: list[int], shape: list[int], digest: str = D3) -> dict[str, Any]:
    return {"offsets": offsets, "shape": shape, "digest": digest}


TILES_4X4 = [chunk([0, 0], [2, 2], D3), chunk([0, 2], [2, 2], D4), chunk([2, 0], [2, 2], D5), chunk([2, 2], [2, 2], D6)]


def chunked_entry(chunks: list[dict[str, Any]], shape: list[int] | None = None) -> dict[str, Any]:
    entry = model_entry(key="model/big", shape=shape or [4, 4], param="big")
    del entry["digest"]
    return entry | {"chunks": chunks}


def body(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "tensors": [model_entry(), optim_entry()],
        "state": {
            "optim": {
                "state": {"0": {"exp_avg": {"__tensor__": "optim/state/0/exp_avg"}, "step": 3}},
                "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": [0], "foreach": None}],
            },
            "scheduler": {"last_epoch": 4, "_last_lr": [0.001]},
            "extra": {"epoch": 2, "note": "ok", "rng": [1, -(2**63), 2**63 - 1]},
        },
        "step": 10,
        "metrics": {"loss": 0.25, "val/acc": 1},
        "library": {"ckptstore": "0.1.0", "torch": "2.4.0"},
    }
    return copy.deepcopy(data | changes)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def manifest(**changes: Any) -> Manifest:
    return Manifest(**(body() | {"run_id": "run-1", "version": 3, "parent": 2, "created_at": CREATED} | changes))


# --------------------------------------------------------------------------- valid bodies


def test_valid_body() -> None:
    parsed = validate_body(body())
    assert isinstance(parsed, ManifestBody)
    assert parsed.format == FORMAT_VERSION == "ckptstore.manifest/1"
    assert parsed.digest_algorithm == "blake3"
    assert [t.key for t in parsed.tensors] == ["model/layer.weight", "optim/state/0/exp_avg"]
    assert parsed.digests() == {D1, D2}
    assert parsed.tensors[0].nbytes == 24
    assert ManifestBody(**body()) == parsed


def test_minimal_body_gets_defaults() -> None:
    parsed = validate_body({"tensors": []})
    assert parsed.state == {} and parsed.metrics == {} and parsed.library == {} and parsed.step is None


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(body(tensors=[chunked_entry(TILES_4X4)], state={}), id="four-2x2-tiles-of-4x4"),
        pytest.param(
            body(tensors=[chunked_entry([chunk([2, 2], [2, 2], D6), *TILES_4X4[:3]])], state={}),
            id="tiles-in-any-order",
        ),
        pytest.param(
            body(tensors=[chunked_entry([chunk([0], [3]), chunk([3], [2], D4)], shape=[5])], state={}),
            id="uneven-1d-tiles",
        ),
        pytest.param(body(tensors=[chunked_entry([chunk([0, 0], [4, 4])])], state={}), id="one-chunk"),
        pytest.param(body(step=0), id="step-0"),
        pytest.param(body(step=2**63 - 1), id="step-int64-max"),
        pytest.param(body(tensors=[model_entry(shape=[0, 3]), optim_entry()]), id="empty-tensor"),
        pytest.param(body(tensors=[model_entry(shape=[]), optim_entry()]), id="scalar"),
        pytest.param(body(tensors=[model_entry(placement="host", param=None), optim_entry()]), id="host"),
        pytest.param(body(tensors=[model_entry(), optim_entry(placement="target", param=None)]), id="target"),
        pytest.param(body(tensors=[model_entry(trainable=False), optim_entry()]), id="frozen"),
        pytest.param(
            body(tensors=[model_entry(dtype="I64", dtype_class="integer"), optim_entry()]), id="integer-class"
        ),
        pytest.param(body(tensors=[model_entry(dtype="BOOL", dtype_class="bool"), optim_entry()]), id="bool-class"),
        pytest.param(body(tensors=[model_entry(dtype="C64", dtype_class="complex"), optim_entry()]), id="complex"),
        pytest.param(body(state={"extra": nested(MAX_JSON_DEPTH)}), id="state-64-deep"),
    ],
)
def test_accepted(data: dict[str, Any]) -> None:
    assert validate_body(data) == ManifestBody(**data)


def test_chunked_entry_reports_its_chunk_digests() -> None:
    entry = TensorEntry(**chunked_entry(TILES_4X4))
    assert entry.digest is None
    assert entry.digests() == [D3, D4, D5, D6]
    assert all(isinstance(c, Chunk) for c in entry.chunks or ())


# --------------------------------------------------------------------------- strict rejections


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Mutation setting ``a/0/b`` style paths inside a body."""

    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = data
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = data
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        del target[last]

    return mutate


def _tensors(*entries: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return _set("tensors", list(entries))


def _chunks(*chunks: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        data["tensors"] = [chunked_entry(list(chunks))]
        data["state"] = {}

    return mutate


REJECTED = [
    # unknown fields
    pytest.param(_set("extra_field", 1), "extra_field: Extra inputs", id="unknown-top-field"),
    pytest.param(_set("tensors/0/offset", 0), "tensors/0/offset: Extra inputs", id="unknown-tensor-field"),
    pytest.param(_chunks({**TILES_4X4[0], "x": 1}, *TILES_4X4[1:]), "Extra inputs", id="unknown-chunk-field"),
    # wrong types for ints
    pytest.param(_set("step", "1"), "step: Input should be a valid integer", id="string-for-int"),
    pytest.param(_set("step", 1.0), "step: Input should be a valid integer", id="float-for-int"),
    pytest.param(_set("step", True), "step: Input should be a valid integer", id="bool-for-int"),
    pytest.param(_set("step", 2**63), "step: Input should be less than or equal", id="step-above-int64"),
    pytest.param(_set("step", 10**30), "step: Input should be less than or equal", id="step-far-above-int64"),
    pytest.param(_set("step", -1), "step: Input should be greater than or equal to 0", id="negative-step"),
    pytest.param(_set("tensors/0/shape", ["2", 3]), "tensors/0/shape/0", id="string-dim"),
    pytest.param(_set("tensors/0/shape", [2.0, 3]), "tensors/0/shape/0", id="float-dim"),
    pytest.param(_set("tensors/0/shape", [True, 3]), "tensors/0/shape/0", id="bool-dim"),
    pytest.param(_set("tensors/0/shape", [-2, -3]), "tensors/0/shape/0: Input should be greater", id="negative-dims"),
    pytest.param(_set("tensors/0/shape", [2**63, 1]), "layer.weight: shape .* overflow 64", id="dim-above-int64"),
    pytest.param(_set("tensors/0/shape", [0, 2**62, 2**62]), "strides overflow 64-bit", id="stride-above-int64"),
    pytest.param(_set("tensors/0/shape", (2, 3)), "tensors/0/shape", id="tuple-shape"),
    pytest.param(_set("tensors/0/shape", [1] * 65), "tensors/0/shape", id="65-dims"),
    pytest.param(_set("tensors/0/shape", [2**62, 2**62]), "too large", id="byte-length-above-int64"),
    # metrics
    # (NaN and the infinities are metrics too, spelled "NaN", "Infinity", "-Infinity": test_metric_values.py)
    pytest.param(_set("metrics/loss", "nan"), "metrics/loss", id="lower-case-nan-metric"),
    pytest.param(_set("metrics/loss", "inf"), "metrics/loss", id="python-inf-metric"),
    pytest.param(_set("metrics/loss", "0.5"), "metrics/loss", id="numeric-string-metric"),
    pytest.param(_set("metrics/loss", True), "metrics/loss", id="bool-metric"),
    pytest.param(_set("metrics", {"../x": 1.0}), "metrics", id="metric-name-traversal"),
    pytest.param(_set("metrics", {"a\nb": 1.0}), "metrics", id="metric-name-newline"),
    # tensor entries
    pytest.param(_set("tensors/0/dtype_class", "integer"), "does not match dtype", id="dtype-class-mismatch"),
    pytest.param(_set("tensors/0/dtype", "f32"), "tensors/0/dtype", id="lowercase-dtype"),
    pytest.param(_set("tensors/0/dtype", "float32"), "tensors/0/dtype", id="torch-dtype-name"),
    pytest.param(_set("tensors/0/chunks", TILES_4X4), "exactly one of digest and chunks", id="digest-and-chunks"),
    pytest.param(_delete("tensors/0/digest"), "exactly one of digest and chunks", id="neither-digest-nor-chunks"),
    pytest.param(_set("tensors/0/digest", D1.upper()), "tensors/0/digest", id="uppercase-digest"),
    pytest.param(_set("tensors/0/digest", D1[:63]), "tensors/0/digest", id="63-char-digest"),
    pytest.param(_set("tensors/0/digest", D1 + "\n"), "tensors/0/digest", id="digest-trailing-newline"),
    pytest.param(_set("tensors/0/digest", "sha256:" + D1), "tensors/0/digest", id="prefixed-digest"),
    pytest.param(_delete("tensors/0/param"), "'param' is required", id="placement-param-without-param"),
    pytest.param(_set("tensors/0/placement", "host"), "'param' is required", id="param-without-placement-param"),
    pytest.param(_set("tensors/0/placement", "cuda"), "tensors/0/placement", id="unknown-placement"),
    pytest.param(_delete("tensors/0/trainable"), "'trainable' is required", id="trainable-missing-for-model"),
    pytest.param(_set("tensors/1/trainable", False), "'trainable' is required", id="trainable-on-optim"),
    pytest.param(_set("tensors/0/trainable", 1), "tensors/0/trainable", id="int-for-bool"),
    pytest.param(_set("tensors/0/key", "layer.weight"), "tensors/0/key", id="key-without-section"),
    pytest.param(_set("tensors/0/key", "model/"), "tensors/0/key", id="empty-key-name"),
    pytest.param(_set("tensors/0/key", "model/a\x00b"), "tensors/0/key", id="nul-in-key"),
    pytest.param(_set("tensors/0/key", "model/a\n"), "tensors/0/key", id="newline-in-key"),
    pytest.param(_set("tensors/0/param", "a\rb"), "tensors/0/param", id="cr-in-param"),
    pytest.param(_set("tensors/0/device_type", "cuda:0; rm -rf /"), "tensors/0/device_type", id="device-injection"),
    pytest.param(_set("tensors/0/device_type", "cuda:-1"), "tensors/0/device_type", id="device-index"),
    pytest.param(_set("tensors/0/device_type", "CUDA"), "tensors/0/device_type", id="device-uppercase"),
    pytest.param(_set("tensors/0/device_type", ""), "tensors/0/device_type", id="device-empty"),
    pytest.param(_set("tensors/0/device_type", "x" * 10_000), "tensors/0/device_type", id="device-10kb"),
    pytest.param(_tensors(model_entry(), model_entry(digest=D3), optim_entry()), "appears twice", id="duplicate-keys"),
    pytest.param(_set("tensors", "not a list"), "tensors", id="tensors-not-a-list"),
    pytest.param(_delete("tensors"), "tensors: Field required", id="tensors-missing"),
    # identity fields
    pytest.param(_set("format", "ckptstore.manifest/2"), "format", id="future-format"),
    pytest.param(_set("digest_algorithm", "sha256"), "digest_algorithm", id="other-digest-algorithm"),
    pytest.param(_set("library", {"torch": "x" * 201}), "library", id="library-value-too-long"),
    # state
    pytest.param(_set("state/optim/state/0/exp_avg", {"__tensor__": "optim/x"}), "does not list", id="unlisted-ref"),
    pytest.param(_set("state/extra", {"__tensor__": "model/nope"}), "does not list", id="unlisted-ref-at-root"),
    pytest.param(_set("state/model", {}), "state/model", id="state-section-model"),
    pytest.param(_set("state/extra", nested(MAX_JSON_DEPTH + 1)), "nested deeper than 64", id="state-65-deep"),
    pytest.param(_set("state/extra", nested(100_000)), "state/extra", id="state-100000-deep"),
    pytest.param(_set("state/extra/x", float("nan")), "state/extra", id="nan-in-state"),
    pytest.param(_set("state/scheduler/_last_lr", [float("inf")]), "state/scheduler", id="inf-in-state"),
    pytest.param(_set("state/extra/x", 2**63), "does not fit in 64 bits", id="int-above-int64-in-state"),
    pytest.param(_set("state/extra/x", -(2**63) - 1), "does not fit in 64 bits", id="int-below-int64-in-state"),
    pytest.param(_set("state/extra/x", b"bytes"), "state/extra", id="bytes-in-state"),
    pytest.param(_set("state/extra/x", {1, 2}), "state/extra", id="set-in-state"),
    # chunks
    pytest.param(
        _chunks(chunk([0, 0], [2, 4], D3), chunk([1, 0], [2, 4], D4)), "two chunks overlap", id="overlapping-chunks"
    ),
    pytest.param(
        _chunks(TILES_4X4[0], TILES_4X4[0], *TILES_4X4[2:]), "two chunks overlap", id="duplicate-chunk-and-a-gap"
    ),
    pytest.param(_chunks(*TILES_4X4[:3]), "do not cover", id="gap"),
    pytest.param(_chunks(*TILES_4X4, chunk([0, 0], [1, 1])), "do not cover", id="extra-chunk"),
    pytest.param(_chunks(*TILES_4X4[:3], chunk([3, 3], [2, 2], D6)), "reaches outside", id="out-of-bounds"),
    pytest.param(_chunks(*TILES_4X4[:3], chunk([2, 2, 0], [2, 2, 1], D6)), "dimensions", id="wrong-rank"),
    pytest.param(_chunks(*TILES_4X4, chunk([0, 0], [0, 2])), "is empty", id="empty-chunk"),
    pytest.param(_chunks(), "chunks", id="no-chunks"),
    pytest.param(_chunks(*TILES_4X4[:3], chunk([2, 2], [2, 2], "x")), "chunks/3/digest", id="bad-chunk-digest"),
    pytest.param(_chunks(*TILES_4X4[:3], chunk([2, "2"], [2, 2], D6)), "chunks/3/offsets", id="string-chunk-offset"),
]


@pytest.mark.parametrize(("mutate", "match"), REJECTED)
def test_validate_body_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    data = body()
    mutate(data)
    with pytest.raises(InvalidManifestError, match=match) as info:
        validate_body(data)
    assert info.value.code == "invalid_manifest" and info.value.http_status == 422
    assert len(str(info.value)) < 5000


@pytest.mark.parametrize(("mutate", "match"), REJECTED)
def test_direct_construction_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    data = body()
    mutate(data)
    with pytest.raises(ValidationError):
        ManifestBody(**data)


@pytest.mark.parametrize("data", [None, [], "tensors", 1, b"{}"])
def test_validate_body_rejects_non_objects(data: object) -> None:
    with pytest.raises(InvalidManifestError):
        validate_body(data)


def test_models_are_frozen() -> None:
    parsed = validate_body(body())
    with pytest.raises(ValidationError):
        parsed.step = 11  # type: ignore[misc]


# --------------------------------------------------------------------------- stored manifests

GOLDEN_JSON = (
    '{"format":"ckptstore.manifest/1","digest_algorithm":"blake3","tensors":['
    '{"key":"model/w","dtype":"F32","shape":[2],"dtype_class":"floating","digest":"' + D1 + '",'
    '"placement":"param","param":"w","device_type":"cpu","trainable":true},'
    '{"key":"model/big","dtype":"F32","shape":[4,4],"dtype_class":"floating","chunks":['
    '{"offsets":[0,0],"shape":[2,2],"digest":"' + D3 + '"},{"offsets":[0,2],"shape":[2,2],"digest":"' + D4 + '"},'
    '{"offsets":[2,0],"shape":[2,2],"digest":"' + D5 + '"},{"offsets":[2,2],"shape":[2,2],"digest":"' + D6 + '"}],'
    '"placement":"param","param":"big","device_type":"cpu","trainable":true}],'
    '"state":{"extra":{"w":{"__tensor__":"model/w"}}},"metrics":{},"library":{},'
    '"run_id":"run-1","version":1,"created_at":"2024-01-02T03:04:05Z"}'
)


def golden_manifest() -> Manifest:
    return Manifest(
        tensors=[
            model_entry(key="model/w", shape=[2], param="w"),
            chunked_entry(TILES_4X4),
        ],
        state={"extra": {"w": {"__tensor__": "model/w"}}},
        run_id="run-1",
        version=1,
        created_at=CREATED,
    )


def test_manifest_json_golden() -> None:
    assert manifest_to_json(golden_manifest()) == GOLDEN_JSON


def test_manifest_json_round_trip() -> None:
    original = manifest()
    text = manifest_to_json(original)
    assert manifest_from_json(text) == original
    assert manifest_from_json(text.encode()) == original
    assert manifest_from_json(GOLDEN_JSON) == golden_manifest()
    document = json.loads(text)
    assert "chunks" not in document["tensors"][0]
    assert "trainable" not in document["tensors"][1]  # absent optional fields are left out, not null
    assert "null" not in GOLDEN_JSON


@pytest.mark.parametrize(
    ("data", "parent"),
    [
        (body(), 2),
        (body(step=None, metrics={}, library={}, state={}), None),
        (
            {
                "tensors": [model_entry(key="model/w", shape=[2], param="w"), chunked_entry(TILES_4X4)],
                "state": {"extra": {"w": {"__tensor__": "model/w"}}},
            },
            None,
        ),
    ],
)
def test_stamp_stores_what_validating_the_whole_gives(data: dict[str, Any], parent: int | None) -> None:
    validated = validate_body(data)
    identity: dict[str, Any] = {"run_id": "run-1", "version": 1 if parent is None else 3, "parent": parent}
    stamped = stamp(validated, **identity, created_at=CREATED)
    rebuilt = Manifest(**validated.model_dump(exclude={"format", "digest_algorithm"}), **identity, created_at=CREATED)
    assert stamped == rebuilt
    assert manifest_to_json(stamped) == manifest_to_json(rebuilt)
    assert manifest_from_json(manifest_to_json(stamped)) == rebuilt


def test_stamp_golden() -> None:
    validated = validate_body(
        {
            "tensors": [model_entry(key="model/w", shape=[2], param="w"), chunked_entry(TILES_4X4)],
            "state": {"extra": {"w": {"__tensor__": "model/w"}}},
        }
    )
    assert manifest_to_json(stamp(validated, run_id="run-1", version=1, parent=None, created_at=CREATED)) == GOLDEN_JSON


def test_round_trip_changes_nothing_observable() -> None:
    original = manifest(tensors=[chunked_entry(TILES_4X4), optim_entry()], state={})
    loaded = manifest_from_json(manifest_to_json(original))
    assert loaded.model_dump() == original.model_dump()
    assert loaded.created_at == CREATED and loaded.created_at.tzinfo is not None
    assert loaded.digests() == {D2, D3, D4, D5, D6}
    assert "digest" not in json.loads(manifest_to_json(original))["tensors"][0]


def _text(**changes: Any) -> str:
    document = json.loads(manifest_to_json(manifest())) | changes
    return json.dumps(document)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(_text(run_id="../x"), id="run-id-traversal"),
        pytest.param(_text(run_id="run\n"), id="run-id-newline"),
        pytest.param(_text(run_id=""), id="run-id-empty"),
        pytest.param(_text(version=0), id="version-0"),
        pytest.param(_text(version=2**63), id="version-above-int64"),
        pytest.param(_text(version="3"), id="version-string"),
        pytest.param(_text(version=3.0), id="version-float"),
        pytest.param(_text(parent=0), id="parent-0"),
        pytest.param(_text(created_at="yesterday"), id="bad-date"),
        pytest.param(_text(surprise=1), id="unknown-field"),
        pytest.param(json.dumps({k: v for k, v in json.loads(_text()).items() if k != "created_at"}), id="no-date"),
        pytest.param(_text().replace('"loss": 0.25', '"loss": NaN'), id="nan-literal"),
        pytest.param(_text().replace('"loss": 0.25', '"loss": Infinity'), id="infinity-literal"),
        pytest.param(_text().replace('"loss": 0.25', '"loss": 1e400'), id="1e400"),
        pytest.param(_text(state={"extra": "X"}).replace('"X"', "[" * 100_000 + "]" * 100_000), id="100000-deep"),
        pytest.param("", id="empty"),
        pytest.param("not json", id="garbage"),
        pytest.param("[]", id="array"),
        pytest.param(_text()[:-1], id="truncated"),
        pytest.param(b"\xff" + _text().encode(), id="not-utf8"),
    ],
)
def test_manifest_from_json_rejects(text: str | bytes) -> None:
    with pytest.raises(InvalidManifestError, match="invalid stored manifest"):
        manifest_from_json(text)


# --------------------------------------------------------------------------- JSON Schema


def test_schema_file_matches_the_models() -> None:
    assert SCHEMA_FILE.read_text(encoding="utf-8") == schema_text(), (
        "docs/manifest.schema.json is stale; regenerate it with "
        'python -c "from ckptstore.service.format.manifest import schema_text; '
        "open('docs/manifest.schema.json','w').write(schema_text())\""
    )


def test_schema_describes_a_strict_manifest() -> None:
    schema = json.loads(schema_text())
    assert schema == json_schema()
    assert schema["title"] == FORMAT_VERSION
    assert schema["$id"].endswith("manifest-1.json")
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"tensors", "run_id", "version", "created_at"}
    for name in ("TensorEntry", "Chunk"):
        assert schema["$defs"][name]["additionalProperties"] is False
    assert schema["properties"]["step"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert schema_text().endswith("}\n")
