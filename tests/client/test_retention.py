"""Retention through the client on every backend: ``save(..., keep_last=…)`` and the policy calls,
and on a server with tokens, who may set a policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.errors import InvalidInputError, NotFoundError, PermissionDeniedError
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.api.kit import ADMIN_TOKEN, TOKENS, WRITE_TOKEN
from tests.client.models import TinyNet
from tests.servers import running_server


def numbers(ckpt: client.Client, run_id: str = "run") -> list[int]:
    return [v.version for v in ckpt.versions(run_id)]


def test_save_with_keep_last_leaves_the_last_versions(ckpt: client.Client) -> None:
    for seed in range(5):
        result = ckpt.save("run", TinyNet(seed=seed), step=seed, keep_last=2)
        assert numbers(ckpt)[-1] == result.version
    assert numbers(ckpt) == [4, 5]
    assert [v.step for v in ckpt.versions("run")] == [3, 4]
    policy = ckpt.retention("run")
    assert (policy.keep_last, policy.keep_best, policy.would_remove) == (2, None, [])
    model = TinyNet(seed=99)
    ckpt.load("run", 4, model=model)  # what is kept still loads
    expected = TinyNet(seed=3).state_dict()
    assert all(value.equal(expected[name]) for name, value in model.state_dict().items())


def test_save_with_keep_best_keeps_the_best_by_the_metric(ckpt: client.Client) -> None:
    net = TinyNet()
    for step, loss in enumerate([3.0, 1.0, 2.0, 0.5, 4.0], start=1):
        ckpt.save("run", net, step=step, metrics={"loss": loss}, keep_last=1, keep_best=2, metric="loss")
    assert numbers(ckpt) == [2, 4, 5]  # best: 4 (0.5) and 2 (1.0); last: 5
    ckpt.save("run", net, metrics={"acc": 0.9}, keep_best=1, metric="acc", mode="max")
    assert numbers(ckpt) == [6]  # the policy was replaced: the best by acc, and the newest, is version 6


def test_set_show_apply_and_clear_a_policy(ckpt: client.Client) -> None:
    for seed in range(4):
        ckpt.save("run", TinyNet(seed=seed), tags=["first"] if seed == 0 else [])
    set_ = ckpt.set_retention("run", keep_last=1)
    assert (set_.run_id, set_.keep_last, set_.mode, set_.would_remove) == ("run", 1, None, [2, 3])
    assert numbers(ckpt) == [1, 2, 3, 4]
    assert ckpt.apply_retention("run") == [2, 3]
    assert numbers(ckpt) == [1, 4]  # 1 is tagged
    cleared = ckpt.set_retention("run")
    assert (cleared.keep_last, cleared.keep_best, cleared.would_remove) == (None, None, [])
    ckpt.save("run", TinyNet())
    assert numbers(ckpt) == [1, 4, 5]


def test_bad_policies_are_refused_before_anything_is_stored(ckpt: client.Client) -> None:
    for bad in ({"keep_last": 0}, {"keep_best": 2}, {"metric": "loss"}, {"keep_best": 1, "metric": "a b"}):
        with pytest.raises(InvalidInputError):
            ckpt.save("run", TinyNet(), **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        ckpt.set_retention("run", keep_last=-1)
    assert ckpt.runs() == []
    with pytest.raises(NotFoundError):
        ckpt.retention("run")


def test_setting_a_policy_needs_an_admin_token_but_saving_with_it_does_not(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "server", tokens=TOKENS)
    store = open_store(settings)
    try:
        with (
            running_server(create_app(store, settings)) as url,
            client.Client(url, token=WRITE_TOKEN) as writer,
            client.Client(url, token=ADMIN_TOKEN) as admin,
        ):
            with pytest.raises(PermissionDeniedError, match="needs an admin token"):
                writer.save("run", TinyNet(), keep_last=2)
            assert writer.runs() == []
            with pytest.raises(NotFoundError, match="run 'run' does not exist"):
                admin.set_retention("run", keep_last=2)
            admin.set_retention("run", keep_last=2, create_run=True)
            for seed in range(3):  # the policy asked for is the one set: no admin needed
                writer.save("run", TinyNet(seed=seed), keep_last=2)
            assert numbers(writer) == [2, 3]
            with pytest.raises(PermissionDeniedError):
                writer.save("run", TinyNet(), keep_last=5)
            with pytest.raises(PermissionDeniedError):
                writer.apply_retention("run")
            assert numbers(writer) == [2, 3]
    finally:
        store.close()
