"""Resume with nothing to remember: every version records the random number generators, a load
that resumes puts them back, and a ``StatefulDataLoader`` passed to save and load goes on at the
next batch of its epoch.

The proof is two real processes (:mod:`tests.client.resume_job`): 20 steps with dropout, a
shuffled loader and a NumPy + Python random augmentation, a save mid-epoch with no ``extra``,
then a fresh process that resumes from the store; its 20 losses are the uninterrupted run's,
bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptstore import client
from ckptstore.client.resume.rng import capture_rng, from_json, restore_rng, to_json
from ckptstore.client.resume.section import SECTION
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from tests.client.conftest import Backend
from tests.client.models import TinyNet

ROOT = Path(__file__).resolve().parents[2]
STOP, END = 20, 40


def job(*args: str, store: dict[str, str]) -> list[str]:
    """Run :mod:`tests.client.resume_job` in a new process on ``store`` (its environment); its losses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")} | store
    done = subprocess.run(
        [sys.executable, "-m", "tests.client.resume_job", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    losses: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return losses


def store_of(backend: Backend, tmp_path: Path) -> dict[str, str]:
    """The environment that names ``backend``'s store to another process."""
    url = getattr(backend.client.transport, "url", None)
    return {"CKPTSTORE_URL": url} if url else {"CKPTSTORE_HOME": str(tmp_path / "store")}


@pytest.fixture(scope="module")
def straight() -> list[str]:
    """The losses of the uninterrupted 40-step run (it needs no store)."""
    return job("straight", str(END), store={"CKPTSTORE_HOME": "/nonexistent-store"})


def test_a_new_process_resumes_mid_epoch_bit_for_bit(backend: Backend, tmp_path: Path, straight: list[str]) -> None:
    store = store_of(backend, tmp_path)
    first = job("first", str(STOP), "streams", store=store)
    assert first == straight[:STOP]
    second = job("second", str(END), "streams", store=store)
    assert second == straight[STOP:]
    manifest = backend.client.transport.manifest("streams", "latest")
    recorded = manifest.state[SECTION]
    assert isinstance(recorded, dict) and set(recorded) == {"rng", "stateful"} and "extra" not in manifest.state


def test_without_the_generators_and_the_loader_the_resumed_run_differs(tmp_path: Path, straight: list[str]) -> None:
    """What a save held before it recorded them: the same job, resumed, draws other numbers."""
    store = {"CKPTSTORE_HOME": str(tmp_path / "store")}
    assert job("first", str(STOP), "plain", "--plain", store=store) == straight[:STOP]
    second = job("second", str(END), "plain", "--plain", store=store)
    assert len(second) == END - STOP and second != straight[STOP:]


# -- in one process: the switches --------------------------------------------------------------


def draws() -> tuple[torch.Tensor, float, float]:
    """One draw from torch's, NumPy's and Python's global generators."""
    return torch.rand(4), float(np.random.rand()), random.random()


def same(a: tuple[torch.Tensor, float, float], b: tuple[torch.Tensor, float, float]) -> bool:
    """Whether two :func:`draws` are equal."""
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_resume_restores_the_generators_and_a_weights_load_leaves_them(ckpt: client.Client) -> None:
    model = TinyNet()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save("gens", model, optim)
    expected = draws()
    assert not same(draws(), expected)  # the generators moved on

    inference = TinyNet(seed=3)
    before = random.getstate(), np.random.get_state(legacy=True)[2], torch.get_rng_state()
    loaded = ckpt.load("gens", model=inference)  # weights for inference: generators untouched
    assert not loaded.rng_restored
    assert (random.getstate(), np.random.get_state(legacy=True)[2]) == before[:2]
    assert torch.equal(torch.get_rng_state(), before[2])

    fresh = TinyNet(seed=4)
    resumed = ckpt.load("gens", model=fresh, optim=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert resumed.rng_restored and same(draws(), expected)

    assert ckpt.load("gens", model=TinyNet(seed=3), rng=True).rng_restored and same(draws(), expected)
    fresh = TinyNet(seed=4)
    forced_off = ckpt.load("gens", model=fresh, optim=torch.optim.SGD(fresh.parameters(), lr=0.1), rng=False)
    assert not forced_off.rng_restored and not same(draws(), expected)


def test_a_version_saved_without_generators_loads_as_before(ckpt: client.Client) -> None:
    model = TinyNet()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save("no-gens", model, optim, rng=False, extra={"epoch": 2})
    manifest = ckpt.transport.manifest("no-gens", "latest")
    assert SECTION not in manifest.state and not any(e.key.startswith("resume/") for e in manifest.tensors)
    fresh = TinyNet(seed=4)
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.1)
    state = torch.get_rng_state()
    loaded = ckpt.load("no-gens", model=fresh, optim=fresh_optim)
    assert not loaded.rng_restored and loaded.extra == {"epoch": 2}
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(StateMismatchError, match="records no random number generator state"):
        ckpt.load("no-gens", model=TinyNet(), rng=True)


def loader_over(values: torch.Tensor) -> StatefulDataLoader:
    """A shuffled loader of ``values`` in batches of 3."""
    return StatefulDataLoader(torch.utils.data.TensorDataset(values), batch_size=3, shuffle=True)


@pytest.mark.filterwarnings("ignore:.*set_vital")
def test_a_stateful_loader_goes_on_at_the_next_batch(ckpt: client.Client) -> None:
    values = torch.arange(30.0)
    loader = loader_over(values)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    model = TinyNet()
    ckpt.save("loader", model, dataloader=loader, stateful={"sampler_note": Counter(7)}, blocking=False).result()
    expected = [b[0] for b in batches]

    fresh, counter = loader_over(values), Counter(0)
    ckpt.load("loader", model=TinyNet(seed=2), dataloader=fresh, stateful={"sampler_note": counter}, rng=False)
    assert counter.count == 7
    got = [b[0] for b in fresh]
    assert len(got) == len(expected) == 6 and all(map(torch.equal, got, expected))

    with pytest.raises(StateMismatchError, match="holds no state for 'other'"):
        ckpt.load("loader", model=TinyNet(), stateful={"other": Counter(0)})
    with pytest.raises(InvalidInputError, match="no state_dict"):
        ckpt.save("loader", model, dataloader=torch.utils.data.DataLoader(values))
    with pytest.raises(InvalidInputError, match="given twice"):
        ckpt.save("loader", model, dataloader=loader, stateful={"dataloader": loader})


class Counter:
    """The smallest object with ``state_dict`` and ``load_state_dict``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def state_dict(self) -> dict[str, int]:
        """Its state."""
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take ``state``."""
        self.count = state["count"]


def test_the_recorded_generators_are_plain_json_and_a_malformed_record_is_refused() -> None:
    written = to_json(capture_rng())
    assert json.loads(json.dumps(written)) == written  # no tensors, nothing but JSON
    expected = draws()
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    restore_rng(from_json(written))
    assert same(draws(), expected)
    for broken in (
        {**written, "torch": "not base64!"},
        {**written, "torch": "AAAA"},  # three bytes: not a generator's state
        {**written, "python": {"version": 3, "state": "x", "gauss": None}},
        {**written, "numpy": {**written["numpy"], "keys": [1, 2, 3]}},
        {k: v for k, v in written.items() if k != "numpy"},
    ):
        with pytest.raises(StateMismatchError, match="random number generator state is malformed"):
            restore_rng(from_json(broken))
