"""A diverging run's pages: versions whose metric is NaN or infinite are listed with it, and the
charts draw the finite points and name the ones they leave out, instead of failing or drawing
a line through NaN coordinates."""

from __future__ import annotations

import math
from pathlib import Path

from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.kit import entry, ingest, raw
from tests.pages.test_pages import page
from tests.pages.test_run_charts import chart, points

LOSSES = [0.5, math.nan, 0.25, math.inf, -math.inf, 0.125]


def test_a_run_with_nan_and_infinite_metrics_renders_its_pages(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    try:
        tensor = raw(41, (2,))
        ingest(store, tensor)
        for step, loss in enumerate(LOSSES, start=1):
            body = ManifestBody(tensors=[entry("model/w", tensor, trainable=True)], step=step, metrics={"loss": loss})
            store.commit("diverged", body)
        # A second run to compare with.
        store.commit("steady", ManifestBody(tensors=[entry("model/w", tensor, trainable=True)], step=1))
        app = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            doc = page(client, "/runs/diverged")
            loss = chart(doc, "loss")
            assert points(loss) == [1, 3, 6]  # the finite ones
            assert all(math.isfinite(float(c.attrs["cy"])) for c in loss.all("circle", class_="pt"))
            note = loss.one("text", class_="left-out")
            assert "v2 NaN, v4 Infinity, v5 -Infinity" in note.text
            assert "nan" not in loss.one("polyline", class_="line").attrs["points"].lower()
            version = client.get("/runs/diverged/versions/2")
            assert version.status_code == 200 and "NaN" in version.text
            assert client.get("/runs/diverged?sort=metric:loss").status_code == 200
            ranged = page(client, "/runs/diverged?metric=loss&min=0")
            assert points(chart(ranged, "loss")) == [1, 3, 6]  # NaN and infinities lie in no range
            assert client.get("/runs/diverged/diff?a=1&b=2").status_code == 200
            assert client.get("/compare?run=diverged&run=steady").status_code == 200
            assert client.get("/").status_code == 200
            listed = client.get("/v1/runs/diverged/versions").json()
            assert [v["metrics"]["loss"] for v in listed] == [0.5, "NaN", 0.25, "Infinity", "-Infinity", 0.125]
    finally:
        store.close()
