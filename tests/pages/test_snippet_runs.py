"""The version page's Python snippet runs as pasted: saved with the real client to a real server,
the snippet read off the page loads the version back into fresh torch objects from that server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import parse
from tests.servers import running_server


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.89, 0.999))


def test_the_snippet_loads_the_version_from_the_server_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_TOKEN", raising=False)
    monkeypatch.delenv("CKPTSTORE_URL", raising=False)
    home = tmp_path / "home"
    store = Store.open_home(home)
    try:
        with running_server(create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))) as url:
            trained, optim = build(0)
            for _ in range(3):
                loss = trained(torch.ones(2, 4)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
            with client.Client(url) as saver:
                saver.save("pasted", trained, optim, step=3, metrics={"loss": float(loss.detach())})
            html = httpx.get(f"{url}/runs/pasted/versions/latest").text
            snippet = parse(html).one("pre", id="snippet-python").one("code")
            text = "".join(part if isinstance(part, str) else "" for part in snippet.children)
            assert f'client.Client("{url}"' in text

            model, fresh = build(1)
            assert not torch.equal(model[0].weight, trained[0].weight)  # differs before the load
            scope = {"model": model, "optim": fresh}
            exec(compile(text, "snippet", "exec"), scope)  # noqa: S102 - the page's own text, as a user pastes it
            loaded = scope["loaded"]
            assert loaded.step == 3
            for mine, theirs in zip(model.parameters(), trained.parameters(), strict=True):
                assert torch.equal(mine, theirs)
            assert fresh.param_groups[0]["betas"] == (0.89, 0.999)
            assert torch.equal(fresh.state[model[0].weight]["exp_avg"], optim.state[trained[0].weight]["exp_avg"])
            scope["store"].close()
    finally:
        store.close()
