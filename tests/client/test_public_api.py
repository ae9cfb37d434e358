"""The public surface of ``from ckptstore import client`` and its environment-driven default client."""

from __future__ import annotations

import importlib
import inspect
import typing
from pathlib import Path

import pytest

from ckptstore import client
from tests.client.models import TinyNet

EXPECTED = {
    "CheckpointError",
    "Client",
    "ConflictError",
    "Connection",
    "IntegrityError",
    "InvalidInputError",
    "InvalidManifestError",
    "InvalidNameError",
    "InvalidShardError",
    "LoadResult",
    "MissingTensorsError",
    "NotFoundError",
    "RunInfo",
    "SaveHandle",
    "SaveResult",
    "StateEncodingError",
    "StateMismatchError",
    "StorageError",
    "StorageFullError",
    "VersionInfo",
    "default_client",
    "load",
    "runs",
    "save",
    "versions",
}


def test_exported_names_are_exactly_the_public_api() -> None:
    assert set(client.__all__) == EXPECTED
    assert all(hasattr(client, name) for name in client.__all__)


@pytest.mark.parametrize("name", ["save", "load", "versions", "runs"])
def test_module_functions_take_exactly_the_methods_arguments(name: str) -> None:
    """``client.save`` etc. spell out every argument of the method they call, with its type and
    default, so a keyword added to the method and forgotten here fails."""
    function = inspect.signature(getattr(client, name))
    method = inspect.signature(getattr(client.Client, name))
    assert list(method.parameters)[0] == "self"
    assert list(function.parameters.values()) == list(method.parameters.values())[1:]
    assert function.return_annotation == method.return_annotation
    if name == "save":  # typed per ``blocking``, like the method
        assert len(typing.get_overloads(client.save)) == len(typing.get_overloads(client.Client.save)) == 3
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in function.parameters.values())


def test_module_save_and_load_pass_every_keyword(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_URL", raising=False)
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path))
    model = TinyNet()
    saved = client.save("run", model, step=7, metrics={"loss": 0.5}, tags=["best"], extra={"note": "x"}, keep_last=2)
    assert [v.tags for v in client.versions("run")] == [["best"]]
    assert client.default_client().retention("run").keep_last == 2
    other = TinyNet(seed=1)
    pairs = list(zip(other.state_dict().values(), model.state_dict().values(), strict=True))
    assert any(not a.equal(b) for a, b in pairs)
    loaded = client.load("run", "best", model=other, strict=True)
    assert (loaded.version, loaded.step, loaded.metrics) == (saved.version, 7, {"loss": 0.5})
    assert loaded.extra == {"note": "x"}
    assert all(a.equal(b) for a, b in pairs)


def test_errors_form_one_tree() -> None:
    for name in EXPECTED:
        value = getattr(client, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, client.CheckpointError)
    assert issubclass(client.NotFoundError, LookupError)
    assert issubclass(client.InvalidInputError, ValueError)


def test_module_functions_read_the_environment_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_URL", raising=False)
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path / "one"))
    client.save("run", TinyNet(), step=1)
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path / "two"))
    client.save("run", TinyNet(), step=2)
    client.save("run", TinyNet(), step=3)
    assert [v.step for v in client.versions("run")] == [2, 3]
    assert [r.run_id for r in client.runs()] == ["run"]
    assert client.load("run", 1).step == 2
    monkeypatch.setenv("CKPTSTORE_HOME", str(tmp_path / "one"))
    assert [v.version for v in client.versions("run")] == [1]
    assert (tmp_path / "one" / "metadata.db").is_file()


def test_home_defaults_to_the_user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTSTORE_HOME", raising=False)
    monkeypatch.delenv("CKPTSTORE_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    client.save("run", TinyNet())
    assert (tmp_path / ".ckptstore" / "metadata.db").is_file()


#: What the README imports from the subpackages: these names stay where they are, whatever
#: moves inside the client.
SUBPACKAGE_NAMES = {
    "ckptstore.client.distributed": {"StoreReader", "StoreWriter"},
    "ckptstore.client.integrations.lightning": {"CkptstoreCheckpointIO", "ResumeStateCallback", "load_from_checkpoint"},
    "ckptstore.client.integrations.transformers": {"CkptstoreCallback", "resume"},
    "ckptstore.client.integrations.accelerate": {"save_state", "load_state"},
}


def test_the_sharded_path_exports_exactly_its_storage_pair() -> None:
    import ckptstore.client.distributed  # noqa: F401  (binds client.distributed for the name below)
    from ckptstore import client

    assert set(client.distributed.__all__) == SUBPACKAGE_NAMES["ckptstore.client.distributed"]


def test_the_integrations_package_exports_nothing_but_its_framework_modules() -> None:
    import ckptstore.client.integrations  # noqa: F401  (binds client.integrations for the name below)
    from ckptstore import client

    # Each framework's module is imported on demand, so ``from ckptstore import client`` imports no framework.
    names = [n for n, v in vars(client.integrations).items() if not n.startswith("_") and not inspect.ismodule(v)]
    assert names == []


@pytest.mark.parametrize("module", sorted(SUBPACKAGE_NAMES))
def test_the_subpackages_public_names_stay_where_they_are(module: str) -> None:
    imported = importlib.import_module(module)
    missing = {name for name in SUBPACKAGE_NAMES[module] if not callable(getattr(imported, name, None))}
    assert missing == set()
