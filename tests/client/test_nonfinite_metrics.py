"""A diverging run still saves: a NaN or infinite metric is stored as what it is and comes back
as that float from every reader (save, versions, load, the listings' JSON), on the embedded
store and over HTTP; the manifest's JSON spells it "NaN", "Infinity" or "-Infinity", and the
metadata the store keeps beside it agrees."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.service.format.manifest import manifest_to_json
from tests.client.conftest import Backend

NAMES = st.from_regex(r"[a-z][a-z0-9_./:-]{0,20}", fullmatch=True)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf]))


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal metrics, NaN equal to NaN, bit for bit otherwise (0.0 and -0.0 differ)."""
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or (a[k] == b[k] and math.copysign(1, a[k]) == math.copysign(1, b[k]))
        for k in a
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metrics=st.dictionaries(NAMES, VALUES, max_size=5))
def test_any_float_metric_round_trips(backend: Backend, metrics: dict[str, float]) -> None:
    ckpt = backend.client
    model = torch.nn.Linear(2, 1)
    saved = ckpt.save("diverging", model, step=3, metrics=metrics, rng=False)
    listed = ckpt.versions("diverging")[-1]
    assert listed.version == saved.version and same(listed.metrics, metrics)
    loaded = ckpt.load("diverging", saved.version, model=torch.nn.Linear(2, 1))
    assert same(loaded.metrics, metrics)
    manifest = ckpt.transport.manifest("diverging", saved.version)
    assert same(manifest.metrics, metrics)
    text = manifest_to_json(manifest)
    assert "NaN," not in text and "Infinity," not in text  # never a bare token
    spelled = json.loads(text, parse_constant=lambda token: pytest.fail(f"bare {token} in a manifest"))["metrics"]
    for name, value in metrics.items():
        if not math.isfinite(value):
            assert spelled[name] == ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity")
    if backend.name == "embedded":  # the store itself: the listed metadata matches the manifest
        assert ckpt.transport.check_metadata("diverging", saved.version) == []  # type: ignore[attr-defined]


def test_a_nan_loss_does_not_fail_the_save_of_a_diverged_run(ckpt: client.Client) -> None:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    loss = torch.nn.functional.mse_loss(model(torch.ones(4, 2)), torch.zeros(4, 1)).item()
    assert math.isnan(loss)
    saved = ckpt.save("nan-run", model, step=100, metrics={"loss": loss, "grad_norm": float("inf")}, blocking=False)
    version = saved.result().version
    assert math.isnan(ckpt.versions("nan-run")[0].metrics["loss"])
    assert ckpt.versions("nan-run")[0].metrics["grad_norm"] == math.inf
    assert ckpt.load("nan-run", version, model=torch.nn.Linear(2, 1)).metrics["grad_norm"] == math.inf


def test_retention_by_a_metric_never_keeps_a_nan_version_as_best(ckpt: client.Client) -> None:
    model = torch.nn.Linear(2, 1)
    for loss in (0.5, math.nan, 0.25, -math.inf, 0.75):
        ckpt.save("kept", model, metrics={"loss": loss}, keep_best=1, metric="loss", mode="min", rng=False)
    # Kept: the best finite loss (v3) and the newest (v5); NaN and -inf are never best.
    assert [v.version for v in ckpt.versions("kept")] == [3, 5]
