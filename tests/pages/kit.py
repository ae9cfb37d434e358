"""A store with runs built by hand for the page tests: shards from raw bytes, no torch.

Run ``alpha`` has two versions whose tensors are shared, changed, added and removed in known
ways (two keys carry HTML meant to run as script); run ``lora-sweep`` has 120 versions with a
metric ``loss`` in a scrambled order and ``val_loss`` on every tenth version.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.format.dtypes import dtype_class
from ckptstore.service.format.manifest import ManifestBody, TensorEntry
from ckptstore.service.format.safetensors_header import encode_header
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.service import shardkit
from tests.service.shardkit import RawTensor as Raw

READ_TOKEN = "pages-read-token-5c1e9a7f30b2"
WRITE_TOKEN = "pages-write-token-84d2b6f1e07c"
TOKENS = f"read:{READ_TOKEN},write:{WRITE_TOKEN}"

SCRIPT_KEY = "extra/<script>alert(1)</script>"
ATTRIBUTE_KEY = 'extra/"><img src=x onerror=alert(1)>'
LONG = "lora-sweep"
LONG_VERSIONS = 120
LONG_TAGS = {120: ["lowest-loss"], 100: ["release-1"]}


def raw(seed: int, shape: Sequence[int] = (4, 4), dtype: str = "F32") -> Raw:
    """A tensor of random bytes drawn from ``seed`` (distinct seeds give distinct digests)."""
    return shardkit.raw(dtype, list(shape), seed)


def ingest(store: Store, *tensors: Raw) -> None:
    """Write a shard of ``tensors`` into the store's staging folder and ingest it."""
    header, _ = encode_header([(t.digest, t.dtype, t.shape) for t in tensors])
    path = store.staging_path()
    path.write_bytes(header + b"".join(t.data for t in tensors))
    store.ingest_file(path)


def entry(
    key: str, t: Raw, *, trainable: bool | None = None, placement: str = "target", param: str | None = None
) -> TensorEntry:
    """A manifest entry storing ``t`` whole under ``key`` (model tensors need ``trainable``)."""
    return TensorEntry.model_validate(
        {
            "key": key,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "dtype_class": dtype_class(t.dtype),
            "digest": t.digest,
            "placement": placement,
            "param": param,
            "device_type": "cpu",
            "trainable": trainable,
        }
    )


def commit(
    store: Store,
    run_id: str,
    tensors: dict[str, tuple[Raw, dict[str, Any]]],
    *,
    tags: Sequence[str] = (),
    **fields: Any,
) -> None:
    """Ingest ``tensors`` (key -> (tensor, entry options)) and commit them as the run's next version."""
    ingest(store, *{t.digest: t for t, _ in tensors.values()}.values())
    entries = [entry(key, t, **options) for key, (t, options) in tensors.items()]
    store.commit(run_id, ManifestBody(tensors=entries, **fields), tags=list(tags))


# Run alpha. v1 -> v2: emb and fc.bias unchanged; fc.weight, exp_avg and step changed; head and
# the two hostile extras added; extra/rng removed.
EMB, FC_W1, FC_B = raw(1, (8, 8)), raw(2), raw(3, (4,))
EXP_AVG1, STEP1, RNG = raw(4), raw(5, ()), raw(6, (16,), "U8")
FC_W2, EXP_AVG2, STEP2, HEAD = raw(12), raw(14), raw(15, ()), raw(7, (2, 4))
HOSTILE1, HOSTILE2 = raw(8, (2,), "I64"), raw(9, (3,), "U8")
LONG_BASE = raw(100, (64, 64))

ALPHA_V1 = {
    "model/emb.weight": (EMB, {"trainable": False}),
    "model/fc.weight": (FC_W1, {"trainable": True}),
    "model/fc.bias": (FC_B, {"trainable": True}),
    "optim/state/fc.weight/exp_avg": (EXP_AVG1, {"placement": "param", "param": "fc.weight"}),
    "optim/state/fc.weight/step": (STEP1, {"placement": "host"}),
    "extra/rng": (RNG, {"placement": "host"}),
}
ALPHA_V2 = {
    "model/emb.weight": (EMB, {"trainable": False}),
    "model/fc.weight": (FC_W2, {"trainable": True}),
    "model/fc.bias": (FC_B, {"trainable": True}),
    "model/head.weight": (HEAD, {"trainable": True}),
    "optim/state/fc.weight/exp_avg": (EXP_AVG2, {"placement": "param", "param": "fc.weight"}),
    "optim/state/fc.weight/step": (STEP2, {"placement": "host"}),
    SCRIPT_KEY: (HOSTILE1, {"placement": "host"}),
    ATTRIBUTE_KEY: (HOSTILE2, {"placement": "host"}),
}


def optim_state(lr: float) -> dict[str, Any]:
    """The JSON part of an optimizer section: one param group holding fc.weight."""
    return {"optim": {"state": {}, "param_groups": [{"lr": lr, "betas": [0.9, 0.999], "params": ["fc.weight"]}]}}


def nbytes(tensors: dict[str, tuple[Raw, dict[str, Any]]]) -> int:
    """Logical bytes of a version's tensors."""
    return sum(len(t.data) for t, _ in tensors.values())


def long_loss(version: int) -> float:
    """Run lora-sweep's loss at ``version``: a permutation of 0.0 … 11.9 (37 is coprime to 120)."""
    return (version * 37 % LONG_VERSIONS) / 10


def long_version(version: int) -> dict[str, tuple[Raw, dict[str, Any]]]:
    """Version ``version`` of run lora-sweep: a frozen base (the same bytes each time), a trainable
    adapter and its optimizer state (new bytes each time)."""
    return {
        "model/base.weight": (LONG_BASE, {"trainable": False}),
        "model/adapter.weight": (raw(1000 + version, (8, 8)), {"trainable": True}),
        "optim/state/adapter.weight/exp_avg": (
            raw(2000 + version, (8, 8)),
            {"placement": "param", "param": "adapter.weight"},
        ),
    }


def seed(store: Store) -> None:
    """Fill ``store`` with runs alpha and lora-sweep."""
    commit(
        store, "alpha", ALPHA_V1, tags=["first"], step=10, metrics={"loss": 2.5, "acc": 0.125}, state=optim_state(0.1)
    )
    commit(store, "alpha", ALPHA_V2, tags=["best"], step=20, metrics={"loss": 1.5, "acc": 0.5}, state=optim_state(0.05))
    for version in range(1, LONG_VERSIONS + 1):
        metrics = {"loss": long_loss(version)}
        if version % 10 == 0:
            metrics["val_loss"] = 13.0 - version / 10
        tags = LONG_TAGS.get(version, [])
        commit(store, LONG, long_version(version), tags=tags, step=version * 100, metrics=metrics)


@contextmanager
def page_client(home: Path) -> Iterator[TestClient]:
    """The app on the store in ``home``, open without tokens on loopback, as a test client (errors as pages)."""
    store = Store.open_home(home)
    try:
        app = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
        with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as test_client:
            yield test_client
    finally:
        store.close()
