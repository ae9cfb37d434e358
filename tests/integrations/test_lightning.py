"""Lightning through CkptstoreCheckpointIO: ModelCheckpoint's top-k and last as tagged versions,
the ``best`` tag, bit-exact resume from the store, callback state with its dtypes and devices,
load_from_checkpoint from a version, refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")  # the .[lightning] extra; installed in CI

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptstore import client  # noqa: E402
from ckptstore.client.formats.importing import import_weights  # noqa: E402
from ckptstore.client.integrations.lightning import (  # noqa: E402
    BEST,
    CkptstoreCheckpointIO,
    ResumeStateCallback,
    load_from_checkpoint,
)
from ckptstore.client.integrations.paths import tag_for_path  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.integrations.lightning_kit import VAL_SCORES, TinyModule, loaders, trainer  # noqa: E402

META = torch.device("meta")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested checkpoint dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def test_top_k_and_last_are_tagged_versions_and_dropped_ones_are_deleted(ckpt: client.Client, tmp_path: Path) -> None:
    callback = ModelCheckpoint(monitor="val_loss", save_top_k=2, mode="min", save_last=True)
    torch.manual_seed(0)
    fit = trainer(tmp_path / "root", epochs=5, plugins=[CkptstoreCheckpointIO("lt", client=ckpt)], callbacks=[callback])
    fit.fit(TinyModule(scripted_val=True), *loaders())

    # The best two epochs by the scripted scores are 3 (0.5) and 1 (1.0); every other epoch's
    # version was deleted when top-k dropped it, and each `last` replaced the one before.
    best = sorted(callback.best_k_models, key=lambda path: callback.best_k_models[path].item())
    assert [Path(p).name for p in best] == ["epoch=3-step=16.ckpt", "epoch=1-step=8.ckpt"]
    versions = ckpt.versions("lt")
    by_tag = {tag: v for v in versions for tag in v.tags}
    assert set(by_tag) == {tag_for_path(best[0]), tag_for_path(best[1]), "last", BEST}
    assert by_tag[BEST].version == by_tag[tag_for_path(best[0])].version
    assert len(versions) == 3
    assert by_tag[tag_for_path(best[0])].metrics == {"val_loss": VAL_SCORES[3]}
    assert by_tag[tag_for_path(best[1])].metrics == {"val_loss": VAL_SCORES[1]}
    assert by_tag[tag_for_path(best[0])].step == 16 and by_tag[tag_for_path(best[1])].step == 8
    assert not [p for p in (tmp_path / "root").rglob("*") if p.is_file()], "no checkpoint file is written"

    # The paths Lightning reports load, and so does the store's own form.
    io = CkptstoreCheckpointIO("lt", client=ckpt)
    best_loaded = io.load_checkpoint(callback.best_model_path)
    assert best_loaded["epoch"] == 3 and best_loaded["global_step"] == 16
    last = io.load_checkpoint("ckptstore://lt@last")
    assert last["global_step"] == by_tag["last"].step
    by_number = io.load_checkpoint(f"ckptstore://lt@{by_tag['last'].version}")
    assert all(tensors_equal(by_number["state_dict"][k], v) for k, v in last["state_dict"].items())


def fit_and_weights(
    io: CkptstoreCheckpointIO, root: Path, seed: int, ckpt_path: str | None = None
) -> tuple[TinyModule, pl.Trainer, ModelCheckpoint]:
    callback = ModelCheckpoint(save_top_k=-1, every_n_epochs=1)
    torch.manual_seed(seed)
    module = TinyModule()
    fit = trainer(root, epochs=4, plugins=[io], callbacks=[callback, ResumeStateCallback()])
    fit.fit(module, *loaders(), ckpt_path=ckpt_path)
    return module, fit, callback


def test_resume_from_the_store_is_bitwise_identical(ckpt: client.Client, tmp_path: Path) -> None:
    # Dropout and a shuffled sampler draw from the RNG after the resume point, so this holds
    # only because ResumeStateCallback put the generators back.
    full, full_trainer, callback = fit_and_weights(CkptstoreCheckpointIO("full", client=ckpt), tmp_path / "a", seed=0)
    assert callback.dirpath is not None
    epoch_1 = str(Path(callback.dirpath) / "epoch=1-step=8.ckpt")  # the path ModelCheckpoint saved to

    resumed, resumed_trainer, _ = fit_and_weights(
        CkptstoreCheckpointIO("full", client=ckpt), tmp_path / "a", seed=7, ckpt_path=epoch_1
    )
    assert resumed_trainer.global_step == full_trainer.global_step == 16
    for key, value in full.state_dict().items():
        assert tensors_equal(resumed.state_dict()[key], value), f"{key} differs after resume"
    full_optim = full_trainer.optimizers[0].state_dict()
    resumed_optim = resumed_trainer.optimizers[0].state_dict()
    for index, state in full_optim["state"].items():
        for name, value in state.items():
            assert tensors_equal(resumed_optim["state"][index][name], value), f"optimizer {index}/{name}"
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.state_dict() == (
        full_trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )
    # The resumed job saved epochs 2 and 3 again: like files overwritten, their names now hold
    # the new versions and the first job's are gone.
    assert [(v.version, v.step) for v in ckpt.versions("full")] == [(1, 4), (2, 8), (5, 12), (6, 16)]
    assert all(BEST not in v.tags for v in ckpt.versions("full")), "no monitor, no best"


def top_k_fit(io: CkptstoreCheckpointIO, root: Path, epochs: int, ckpt_path: str | None = None) -> ModelCheckpoint:
    callback = ModelCheckpoint(monitor="val_loss", save_top_k=2, mode="min", save_last=True)
    fit = trainer(root, epochs=epochs, plugins=[io], callbacks=[callback, ResumeStateCallback()])
    fit.fit(TinyModule(scripted_val=True), *loaders(), ckpt_path=ckpt_path)
    return callback


def test_the_best_tag_follows_model_checkpoint_across_a_resume(store: client.Client, tmp_path: Path) -> None:
    io = CkptstoreCheckpointIO("bt", client=store)
    first = top_k_fit(io, tmp_path, epochs=2)
    (best,) = [v for v in store.versions("bt") if BEST in v.tags]
    assert tag_for_path(first.best_model_path) in best.tags and best.metrics == {"val_loss": VAL_SCORES[1]}
    assert io.load_checkpoint("ckptstore://bt@best")["epoch"] == 1

    # Resumed to 5 epochs: epoch 3's 0.5 becomes the best; epoch 4's 4.0 is not in the top 2,
    # and saving `last` after it leaves the tag where it is.
    second = top_k_fit(io, tmp_path, epochs=5, ckpt_path="ckptstore://bt@last")
    assert Path(second.best_model_path).name == "epoch=3-step=16.ckpt"
    by_tag = {tag: v for v in store.versions("bt") for tag in v.tags}
    assert set(by_tag) == {BEST, "last", tag_for_path(second.best_model_path), tag_for_path(first.best_model_path)}
    assert by_tag[BEST].version == by_tag[tag_for_path(second.best_model_path)].version
    assert len(store.versions("bt")) == 3  # the top 2 and last: the best tag keeps nothing alive
    best_checkpoint = io.load_checkpoint("ckptstore://bt@best")
    assert best_checkpoint["epoch"] == 3 and best_checkpoint["global_step"] == 16

    # The docs' way (docs/trainers.md): the module as it was at the best checkpoint.
    module = load_from_checkpoint(TinyModule, "ckptstore://bt@best", client=store)
    for name, value in best_checkpoint["state_dict"].items():
        assert tensors_equal(module.state_dict()[name], value), name


def test_a_checkpoint_file_named_best_keeps_its_own_tag(store: client.Client, tmp_path: Path) -> None:
    callback = ModelCheckpoint(monitor="val_loss", filename="best", save_top_k=1, save_last=True)
    fit = trainer(tmp_path, epochs=5, plugins=[CkptstoreCheckpointIO("own", client=store)], callbacks=[callback])
    fit.fit(TinyModule(scripted_val=True), *loaders())
    assert sorted(tag for v in store.versions("own") for tag in v.tags) == [BEST, "last"]
    assert CkptstoreCheckpointIO("own", client=store).load_checkpoint("ckptstore://own@best")["epoch"] == 3


def trained(root: Path, plugins: list[Any]) -> tuple[TinyModule, pl.Trainer]:
    torch.manual_seed(0)
    module = TinyModule(width=6, lr=0.02)
    fit = trainer(root, epochs=1, plugins=plugins, callbacks=[])
    fit.fit(module, *loaders())
    return module, fit


def assert_built_from(loaded: TinyModule, trained_module: TinyModule) -> None:
    assert dict(loaded.hparams) == {"width": 6, "lr": 0.02, "scripted_val": False}
    assert loaded.net[0].out_features == 6
    for name, value in trained_module.state_dict().items():
        assert tensors_equal(loaded.state_dict()[name], value), name


def test_load_from_checkpoint_builds_the_module_from_a_version_the_plug_in_saved(
    store: client.Client, tmp_path: Path
) -> None:
    module, fit = trained(tmp_path, plugins=[CkptstoreCheckpointIO("lfc", client=store)])
    fit.save_checkpoint("ckptstore://lfc@manual")
    fresh = TinyModule(width=6)
    assert not tensors_equal(fresh.net[0].weight, module.net[0].weight)  # differs before

    loaded = load_from_checkpoint(TinyModule, "ckptstore://lfc@manual", client=store)
    assert_built_from(loaded, module)
    assert loaded.net[0].weight.device.type == "cpu"
    overridden = load_from_checkpoint(TinyModule, "ckptstore://lfc@latest", client=store, lr=0.5)
    assert overridden.hparams["lr"] == 0.5 and overridden.hparams["width"] == 6
    on_cpu = load_from_checkpoint(TinyModule, "ckptstore://lfc@manual", client=store, map_location="cpu")
    assert_built_from(on_cpu, module)
    with pytest.raises(client.InvalidInputError, match="map_location"):
        load_from_checkpoint(TinyModule, "ckptstore://lfc@manual", client=store, map_location=lambda s, loc: s)
    with pytest.raises(client.InvalidInputError, match="ckptstore://RUN@REF"):
        load_from_checkpoint(TinyModule, str(tmp_path / "manual.ckpt"), client=store)
    with pytest.raises(client.NotFoundError):
        load_from_checkpoint(TinyModule, "ckptstore://lfc@nope", client=store)


def test_load_from_checkpoint_of_an_imported_ckpt_matches_lightnings_own(store: client.Client, tmp_path: Path) -> None:
    module, fit = trained(tmp_path, plugins=[])
    path = tmp_path / "trained.ckpt"
    fit.save_checkpoint(path)
    import_weights(store, path, "imported")

    from_store = load_from_checkpoint(TinyModule, "ckptstore://imported@latest", client=store)
    from_file = TinyModule.load_from_checkpoint(path)
    assert_built_from(from_store, module)
    assert_built_from(from_file, module)
    assert dict(from_store.hparams) == dict(from_file.hparams)


class Data(pl.LightningDataModule):
    """A datamodule with hyperparameters and state of its own."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen = 0

    def train_dataloader(self) -> Any:
        self.seen += 1
        return loaders()[0]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = state_dict["seen"]


def test_load_from_checkpoint_builds_a_datamodule_too(store: client.Client, tmp_path: Path) -> None:
    fit = trainer(tmp_path, epochs=1, plugins=[CkptstoreCheckpointIO("dm", client=store)], callbacks=[])
    fit.fit(TinyModule(), datamodule=Data(batch_size=4))
    fit.save_checkpoint("ckptstore://dm@manual")
    data = load_from_checkpoint(Data, "ckptstore://dm@manual", client=store)
    assert data.hparams["batch_size"] == 4 and data.seen == 1
    with pytest.raises(TypeError, match="neither"):
        load_from_checkpoint(torch.nn.Linear, "ckptstore://dm@manual", client=store)


class StatefulCallback(pl.Callback):
    """Callback state holding tensors of several dtypes, as EMA or metric callbacks keep."""

    def __init__(self) -> None:
        self.state = {
            "ema": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "count": torch.tensor(7, dtype=torch.int64),
            "mask": torch.tensor([True, False]),
            "history": [torch.tensor(1.5, dtype=torch.float64)],
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def saved_with_callback_state(store: client.Client, tmp_path: Path) -> tuple[CkptstoreCheckpointIO, dict[str, Any]]:
    io = CkptstoreCheckpointIO("cb", client=store)
    fit = trainer(tmp_path, epochs=1, plugins=[io], callbacks=[StatefulCallback()])
    fit.fit(TinyModule(), *loaders())
    fit.save_checkpoint("ckptstore://cb@manual")
    state = next(v for k, v in fit._checkpoint_connector.dump_checkpoint()["callbacks"].items() if "Stateful" in k)
    return io, state


def test_callback_state_keeps_its_dtypes_and_comes_back_on_the_cpu(store: client.Client, tmp_path: Path) -> None:
    io, saved = saved_with_callback_state(store, tmp_path)
    loaded = io.load_checkpoint("ckptstore://cb@manual")
    state = next(v for k, v in loaded["callbacks"].items() if "Stateful" in k)
    for name in ("ema", "count", "mask"):
        assert tensors_equal(state[name], saved[name]) and state[name].device.type == "cpu", name
    assert tensors_equal(state["history"][0], saved["history"][0])
    assert loaded["optimizer_states"][0]["state"][0]["step"].dtype == torch.float32
    assert loaded["hyper_parameters"] == {"width": 8, "lr": 1e-2, "scripted_val": False}


def test_map_location_places_every_tensor_with_its_saved_dtype(store: client.Client, tmp_path: Path) -> None:
    io, saved = saved_with_callback_state(store, tmp_path)
    on_cpu = io.load_checkpoint("ckptstore://cb@manual")
    on_meta = io.load_checkpoint("ckptstore://cb@manual", map_location="meta")
    cpu_tensors, meta_tensors = tensors_in(on_cpu), tensors_in(on_meta)
    assert len(meta_tensors) == len(cpu_tensors) > 20
    assert all(t.device == META for t in meta_tensors)
    assert [t.dtype for t in meta_tensors] == [t.dtype for t in cpu_tensors]
    with pytest.raises(client.InvalidInputError, match="map_location"):
        io.load_checkpoint("ckptstore://cb@manual", map_location=lambda storage, loc: storage)


def test_state_saved_from_an_accelerator_returns_to_it(store: client.Client, tmp_path: Path) -> None:
    """A version as a GPU run writes it (callback tensors placed on the load device, saved from
    an accelerator), with meta standing in for the accelerator: its tensors go back there while
    those saved from the CPU stay on the CPU."""
    io, _ = saved_with_callback_state(store, tmp_path)
    manifest = store.transport.manifest("cb", "manual")
    moved = {e.key for e in manifest.tensors if "Stateful" in e.key and e.key.endswith(("/ema", "/count"))}
    assert len(moved) == 2
    entries = [
        e.model_copy(update={"placement": "target", "device_type": "meta"}) if e.key in moved else e
        for e in manifest.tensors
    ]
    body = manifest.model_copy(update={"tensors": entries})
    store.transport.commit("cb", body, tags=["from-accelerator"])

    loaded = io.load_checkpoint("ckptstore://cb@from-accelerator")
    state = next(v for k, v in loaded["callbacks"].items() if "Stateful" in k)
    assert state["ema"].device == META and state["ema"].dtype == torch.bfloat16
    assert state["count"].device == META and state["count"].dtype == torch.int64
    assert state["mask"].device.type == "cpu"
    assert loaded["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "cpu"


def test_values_that_are_not_json_are_refused_naming_the_key(store: client.Client, tmp_path: Path) -> None:
    io = CkptstoreCheckpointIO("bad", client=store)
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"activation": torch.nn.ReLU()}}
    with pytest.raises(client.StateEncodingError, match="extra/hyper_parameters/activation"):
        io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    with pytest.raises(client.NotFoundError):
        store.versions("bad")  # nothing was stored


def test_removing_a_checkpoint_another_tag_keeps_only_drops_its_tag(store: client.Client, tmp_path: Path) -> None:
    io = CkptstoreCheckpointIO("rm", client=store)
    for name in ("a", "b"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / f"{name}.ckpt")
    store.tag("rm", 1, "release")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")
    assert [(v.version, v.tags) for v in store.versions("rm")] == [(1, ["release"])]
    with pytest.raises(client.InvalidInputError, match="tag"):
        io.save_checkpoint({"state_dict": {}}, "ckptstore://rm@3")


def test_pytorch_lightning_package_takes_its_own_plug_in(store: client.Client, tmp_path: Path) -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from ckptstore.client.integrations.lightning import PLCkptstoreCheckpointIO

    class Module(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    fit = ptl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[PLCkptstoreCheckpointIO("ptl", client=store)],
    )
    fit.fit(Module(), loaders()[0])
    assert [v.tags for v in store.versions("ptl")] == [["epoch_1-step_8-" + tag_for_path("epoch=1-step=8")[-8:]]]
