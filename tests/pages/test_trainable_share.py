"""The Trainable share on the run and version pages is the trainable model bytes over the model's
own bytes, never over the logical size (which counts the optimizer's state): a fully trainable
MLP saved with AdamW shows 100%, a LoRA adapter on a frozen Llama its true fraction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.test_pages import page

peft = pytest.importorskip("peft")
from tests.client.test_lora import lora_llama, train_steps  # noqa: E402  (a small Llama with a LoRA adapter)


def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _shown(pages: TestClient, run: str) -> tuple[str, str]:
    """The run page's Trainable cell for the run's latest version, and the version page's share."""
    listing = page(pages, f"/runs/{run}").one("table", id="versions")
    header = listing.header()
    (row,) = [dict(zip(header, cells, strict=True)) for cells in listing.rows()]
    text = page(pages, f"/runs/{run}/versions/latest").one("dd", id="trainable").text
    return row["Trainable"], text.partition("(")[2].partition(" of the model)")[0]


def test_a_fully_trainable_mlp_shows_100_and_a_lora_its_true_share(tmp_path: Path) -> None:
    home = tmp_path / "home"
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    adam = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    mlp(torch.randn(4, 32)).pow(2).mean().backward()
    adam.step()
    lora = lora_llama(0)
    lora_adam = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-3)
    train_steps(lora, lora_adam, range(1))
    with client.Client(home=home) as ckpt:
        mlp_saved = ckpt.save("mlp", mlp, adam)
        lora_saved = ckpt.save("lora", lora, lora_adam)
    # AdamW's two moments besides the weights: over the logical size the MLP would show about 33%.
    assert mlp_saved.bytes_total >= 3 * _bytes(iter(mlp.parameters()))

    trainable = _bytes(p for p in lora.parameters() if p.requires_grad)
    whole = _bytes(iter(lora.state_dict().values()))
    share = f"{100 * trainable / whole:.1f}%"
    assert 0 < trainable < whole < lora_saved.bytes_total

    store = Store.open_home(home)
    try:
        app = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
        with TestClient(app, base_url="http://127.0.0.1") as pages:
            assert _shown(pages, "mlp") == ("100.0%", "100.0%")
            assert _shown(pages, "lora") == (share, share)
    finally:
        store.close()
