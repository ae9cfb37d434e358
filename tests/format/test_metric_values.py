"""Metric values in the manifest: any float, NaN and the infinities included, written to JSON as
the strings "NaN", "Infinity" and "-Infinity" and read back as the floats; a bare NaN or Infinity
token (not JSON), another spelling, or a non-finite number anywhere but a metric is refused."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.service.errors import InvalidManifestError
from ckptstore.service.format.manifest import Manifest, manifest_from_json, manifest_to_json, validate_body
from ckptstore.service.format.names import NON_FINITE, metric_to_json

CREATED = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def stored(metrics: dict[str, float]) -> Manifest:
    """A stored manifest with no tensors and these metrics."""
    return Manifest(tensors=[], metrics=metrics, run_id="run", version=1, created_at=CREATED)


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN and the sign of zero kept."""
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True), st.floats(), max_size=8))
def test_every_float_round_trips_through_the_stored_text(metrics: dict[str, float]) -> None:
    text = manifest_to_json(stored(metrics))
    json.loads(text, parse_constant=lambda token: pytest.fail(f"bare {token}"))  # strict JSON
    back = manifest_from_json(text).metrics
    assert back.keys() == metrics.keys() and all(same(back[k], v) for k, v in metrics.items())


@pytest.mark.parametrize(("value", "spelled"), [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")])
def test_non_finite_metrics_are_spelled_as_python_and_json5_write_them(value: float, spelled: str) -> None:
    assert metric_to_json(value) == spelled and json.dumps(value) == spelled
    assert json.loads(manifest_to_json(stored({"loss": value})))["metrics"]["loss"] == spelled
    body = validate_body({"tensors": [], "metrics": {"loss": spelled}})  # as a server reads a commit
    assert same(body.metrics["loss"], value)
    assert set(NON_FINITE) == {"NaN", "Infinity", "-Infinity"}


@pytest.mark.parametrize(
    "metrics_text",
    [
        '{"loss": NaN}',
        '{"loss": Infinity}',
        '{"loss": -Infinity}',
        '{"loss": 1e400}',
        '{"loss": "nan"}',
        '{"loss": "inf"}',
        '{"loss": "Infinity "}',
        '{"loss": "1.5"}',
        '{"loss": null}',
    ],
)
def test_other_spellings_and_bare_tokens_are_refused(metrics_text: str) -> None:
    text = manifest_to_json(stored({"loss": 1.0})).replace('"metrics":{"loss":1.0}', f'"metrics":{metrics_text}')
    assert metrics_text in text
    with pytest.raises(InvalidManifestError, match="metrics"):
        manifest_from_json(text)


@pytest.mark.parametrize("where", ["step", "state"])
def test_non_finite_numbers_stay_refused_outside_the_metrics(where: str) -> None:
    text = manifest_to_json(stored({"loss": math.nan}))
    hostile = (
        text.replace('"state":{}', '"state":{"extra":{"x":NaN}}') if where == "state" else text[:-1] + ',"step":NaN}'
    )
    assert hostile != text
    with pytest.raises(InvalidManifestError):
        manifest_from_json(hostile)
    with pytest.raises(InvalidManifestError, match="state/extra"):
        validate_body({"tensors": [], "state": {"extra": {"x": math.nan}}})
