"""The version page's tensor filter, load snippets, download names and trainable share; the diff
page's rounding, deltas, changed bytes and, on request, how much each changed tensor's values moved."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.api.pages import tensor_values
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import READ_TOKEN, ingest, page_client, seed
from tests.pages.test_pages import page, sections
from tests.service.shardkit import RawTensor, chunked_entry, entry


def f32(*values: float) -> RawTensor:
    return RawTensor("F32", (len(values),), struct.pack(f"<{len(values)}f", *values))


def bf16(*values: float) -> RawTensor:
    """bfloat16: the upper two bytes of each float32 (the values given are exact in bfloat16)."""
    return RawTensor("BF16", (len(values),), b"".join(struct.pack("<f", v)[2:] for v in values))


def i64(*values: int) -> RawTensor:
    return RawTensor("I64", (len(values),), struct.pack(f"<{len(values)}q", *values))


LR1, LR2 = 0.0025, 0.0022499999999999994  # what 0.0025 * 0.9 prints as, the example
W1, W2 = f32(0.0, 1.0, 2.0, 3.0), f32(0.0, 1.0, 2.5, -3.0)
H1, H2 = bf16(1.0, 2.0, 4.0), bf16(1.0, 2.0, -4.0)
C1, C2, C3 = i64(1, 2), i64(3, 4), i64(3, 5)  # chunks: the second one changes
N1, N2 = f32(math.nan, 1.0), f32(math.nan, 2.0)
M1, M2 = f32(1.0, 0.5), f32(math.nan, 1.0)
BIG1, BIG2 = f32(*[0.0] * 64), f32(*[1.0] * 64)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page tests' runs and run 'nudge', whose two versions change known values."""
    folder = tmp_path_factory.mktemp("diff") / "home"
    store = Store.open_home(folder)
    try:
        seed(store)
        for raws in ([W1, H1, C1, C2, N1, M1, BIG1], [W2, H2, C3, N2, M2, BIG2]):
            ingest(store, *raws)
        for version, (w, h, tail, n, m, big, lr) in enumerate(
            [(W1, H1, C2, N1, M1, BIG1, LR1), (W2, H2, C3, N2, M2, BIG2, LR2)], start=1
        ):
            counts = chunked_entry("extra/counts", "I64", (4,), [([0], C1), ([2], tail)])
            tensors = [entry("model/w", w), entry("model/h", h), counts, entry("extra/n", n), entry("extra/nan", m)]
            tensors.append(entry("extra/big", big))
            state = {"optim": {"state": {}, "param_groups": [{"lr": lr, "betas": [0.9, 0.999], "params": []}]}}
            metrics = {"loss": 1 / 3 if version == 1 else 0.25, "acc": 0.0 if version == 1 else 0.5}
            store.commit("nudge", ManifestBody(tensors=tensors, step=version * 1000, metrics=metrics, state=state))
    finally:
        store.close()
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    with page_client(home) as test_client:
        yield test_client


# -- the version page ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "found"),
    [
        ("AVG", {"Optimizer state": ["fc.weight/exp_avg"]}),  # a substring, ignoring case
        ("Head", {"Model": ["head.weight"]}),
        ("*.bias", {"Model": ["fc.bias"]}),
        ("model/*", {"Model": ["emb.weight", "fc.weight", "fc.bias", "head.weight"]}),
        ("fc.*", {"Model": ["fc.weight", "fc.bias"], "Optimizer state": ["fc.weight/exp_avg", "fc.weight/step"]}),
        ("*step", {"Optimizer state": ["fc.weight/step"]}),
    ],
)
def test_tensors_filter_by_substring_or_glob(client: TestClient, q: str, found: dict[str, list[str]]) -> None:
    doc = page(client, f"/runs/alpha/versions/2?q={q}")
    shown = sections(doc)
    assert {title: list(rows) for title, rows in shown.items()} == found
    matched = sum(len(rows) for rows in found.values())
    assert (
        doc.one("span", id="tensor-matches").text == f"{matched} tensor{'s' if matched != 1 else ''} of 8 match “{q}”"
    )
    assert doc.one("input", name="q").attrs["value"] == q
    assert "Logical size 455 B" in doc.one("div", class_="facts").text  # the figures stay the whole version's


def test_a_filter_matching_nothing_or_holding_markup_is_text(client: TestClient) -> None:
    response = client.get("/runs/alpha/versions/2?q=%3Cscript%3E[x")
    assert response.status_code == 200 and "<script>[x" not in response.text
    doc = parse(response.text)
    assert sections(doc) == {}
    assert doc.one("p", class_="empty").text == "No tensor key holds “<script>[x” or matches it as a glob."
    too_long = client.get("/runs/alpha/versions/2?q=" + "x" * 201)
    assert too_long.status_code == 422 and "q" in parse(too_long.text).one("p", class_="message").text


def test_the_version_page_says_how_to_load_it(client: TestClient, guarded: TestClient) -> None:
    doc = page(client, "/runs/alpha/versions/best")
    python = doc.one("pre", id="snippet-python").text
    assert 'store.load("alpha", version=2, model=model, optim=optim)' in python
    # The store the page came from, the token from the environment: it runs as pasted.
    assert 'store = client.Client("http://127.0.0.1", token=os.environ.get("CKPTSTORE_TOKEN"))' in python
    cli = doc.one("pre", id="snippet-cli").text
    assert "export CKPTSTORE_URL=http://127.0.0.1" in cli
    assert "ckptstore show alpha@2" in cli and "ckptstore export alpha@2 ./alpha-v2" in cli
    weights_only = page(client, "/runs/nudge/versions/1").one("pre", id="snippet-python").text
    assert 'store.load("nudge", version=1, model=model, optim=optim)' in weights_only  # optim as JSON state
    # A Host a server with tokens answers is still not pasted into a shell line as it came.
    hostile = guarded.get(
        "/runs/alpha/versions/2", headers={"Host": "evil$(reboot)", "Authorization": f"Bearer {READ_TOKEN}"}
    )
    assert "export CKPTSTORE_URL=http://HOST:PORT" in parse(hostile.text).one("pre", id="snippet-cli").text
    assert 'client.Client("http://HOST:PORT"' in parse(hostile.text).one("pre", id="snippet-python").text
    assert READ_TOKEN not in hostile.text  # never the token, though the request carried one
    assert client.get("/runs/alpha/versions/2", headers={"Host": "evil$(reboot)"}).status_code == 403  # no tokens


def test_trainable_share_has_one_denominator_on_every_page(client: TestClient) -> None:
    run = page(client, "/runs/alpha")
    header = run.one("table", id="versions").header()
    cells = {row[1]: dict(zip(header, row, strict=True)) for row in run.one("table", id="versions").rows()}
    version = page(client, "/runs/alpha/versions/2")
    assert cells["v2"]["Trainable"] == "30.4%"  # 112 B of the model's 368 B, not of the logical 455 B
    assert version.one("dd", id="trainable").text == "112 B (30.4% of the model)"


def test_downloads_are_named_by_tensor_key(client: TestClient) -> None:
    doc = page(client, "/runs/nudge/versions/2")
    hrefs = {a.attrs["href"] for a in doc.all("a", class_="dl")}
    assert "/runs/nudge/versions/2/tensor?name=model/w" in hrefs
    response = client.get("/runs/nudge/versions/2/tensor?name=model/w")
    assert response.content == W2.data
    assert response.headers["content-disposition"] == 'attachment; filename="model.w.f32.bin"'


# -- the diff page -------------------------------------------------------------------------------


def values(doc: Node) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in doc.one("table", id="values").rows()}


def test_numbers_are_rounded_for_reading_and_exact_on_hover(client: TestClient) -> None:
    doc = page(client, "/runs/nudge/diff?a=1&b=2")
    found = values(doc)
    assert found["optim/param_groups/0/lr"] == ["0.00250", "0.00225", "−0.00025", "−10.0%"]
    assert found["metrics/loss"] == ["0.333333", "0.250000", "−0.083333", "−25.0%"]
    assert found["metrics/acc"] == ["0.0", "0.5", "+0.5", "—"]  # no relative change from 0
    assert found["step"] == ["1,000", "2,000", "+1,000", "—"]  # a counter: no percentage
    cells = {cell.text: cell.attrs.get("title") for cell in doc.one("table", id="values").all("td")}
    assert cells["0.00225"] == repr(LR2) == "0.0022499999999999994"
    assert cells["0.333333"] == repr(1 / 3)
    assert cells["−0.00025"] == repr(LR2 - LR1)
    assert "0.0022499999999999994" not in "".join(doc.one("table", id="values").text)


def test_changed_tensors_show_the_bytes_that_changed(client: TestClient) -> None:
    doc = page(client, "/runs/nudge/diff?a=1&b=2")
    rows = {row[1]: row for row in doc.one("table", id="tensors").rows()}
    assert rows["extra/counts"][4:] == ["32 B", "16 B"]  # one of its two 16-byte chunks changed
    assert rows["model/w"][4:] == ["16 B", "16 B"]
    assert "Elements changed" not in doc.one("table", id="tensors").header()
    assert ("/runs/nudge/diff?a=1&b=2&values=1", "compare the changed tensors' values") in doc.links()


def test_on_request_each_changed_tensors_values_are_compared(client: TestClient) -> None:
    doc = page(client, "/runs/nudge/diff?a=1&b=2&values=1")
    table = doc.one("table", id="tensors")
    assert table.header()[-2:] == ["Elements changed", "Largest |Δ|"]
    rows = {row[1]: row[6:] for row in table.rows()}
    assert rows["model/w"] == ["2 of 4 (50.0%)", "6"]  # 2 -> 2.5 and 3 -> -3
    assert rows["model/h"] == ["1 of 3 (33.3%)", "8"]  # bfloat16 4 -> -4
    assert rows["extra/counts"] == ["1 of 4 (25.0%)", "1"]  # only the changed chunk is read
    assert rows["extra/n"] == ["1 of 2 (50.0%)", "1"]  # NaN against the same NaN: no change
    assert rows["extra/nan"] == ["2 of 2 (100.0%)", "0.5 +1 NaN"]  # a value became NaN
    assert rows["extra/big"] == ["64 of 64 (100.0%)", "1"]
    assert ("/runs/nudge/diff?a=1&b=2", "skip the comparison") in doc.links()


def test_the_comparison_reads_at_most_its_budget(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_values, "MAX_COMPARED_BYTES", 200)  # extra/big (256 B) does not fit
    rows = {
        row[1]: row[6:] for row in page(client, "/runs/nudge/diff?a=1&b=2&values=1").one("table", id="tensors").rows()
    }
    assert rows["extra/big"] == ["not compared: past the 0 MiB a page reads from each version"]
    assert rows["model/w"] == ["2 of 4 (50.0%)", "6"]


def test_a_bad_values_flag_is_a_422_page(client: TestClient) -> None:
    response = client.get("/runs/nudge/diff?a=1&b=2&values=maybe")
    assert response.status_code == 422 and "values" in parse(response.text).one("p", class_="message").text
