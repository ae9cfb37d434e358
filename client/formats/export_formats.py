"""Export a version as a PEFT adapter folder or as a DCP checkpoint folder.

- **PEFT adapter** (``adapter_model.safetensors`` + ``adapter_config.json``), loadable by
  ``peft.PeftModel.from_pretrained(base, folder)``: the tensors ``save_pretrained`` writes of the
  adapter (its LoRA and DoRA tensors, its ``modules_to_save`` copies, and the embedding layers
  under LoRA on an embedding; or those the caller's ``keys`` select) under PEFT's file names,
  which leave out the adapter's name (``…q_proj.lora_A.default.weight`` is written as
  ``…q_proj.lora_A.weight``; :mod:`client.formats.hf.peft_names`).
  The config is the one given, or the JSON the version holds: ``extra["peft_configs"][adapter]``
  when it holds several adapters' configs, else ``extra["peft_config"]`` (the Trainer plug-in
  stores both, a PEFT folder import the latter; by hand: ``extra={"peft_config":
  model.peft_config["default"].to_dict()}``, sets as lists); export never invents one.
  ``ckptstore import`` of the folder stores it back (:mod:`client.formats.hf.peft_folder`).
- **DCP folder**, readable by ``torch.distributed.checkpoint.load``: ``{"model": state_dict,
  "optim": optimizer state by parameter name}``, the layout ``get_state_dict`` gives and
  ``set_state_dict`` takes; a version imported from a torchtitan or torchtune folder goes back in
  that framework's layout (:mod:`client.formats.dcp_layouts`).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats.dcp_layouts import written_layout
from ckptstore.client.formats.exporting import (
    FILE_METADATA,
    ExportResult,
    stored_json,
    write_safetensors,
    write_text_atomically,
)
from ckptstore.client.formats.hf.peft_folder import ADAPTER_CONFIG, ADAPTER_FILE
from ckptstore.client.formats.hf.peft_names import export_names, file_name
from ckptstore.client.loading import restore, selection
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.state import is_positional
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import CheckpointError, InvalidInputError, StateMismatchError, StorageError

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "export_dcp", "export_peft", "peft_file_name"]

#: What torch.distributed.checkpoint warns of on every single-process save, which an export is:
#: that no process group runs, and, over an earlier export, that it overwrites it.
DCP_NOTICES = (
    r"torch\.distributed is disabled, unavailable or uninitialized",
    r"Detected an existing checkpoint in .*, overwriting",
)


def peft_file_name(name: str, adapter: str) -> str:
    """The name PEFT writes for a state_dict name of adapter ``adapter``
    (:func:`~client.formats.hf.peft_names.file_name`); any other name without its ``.<adapter>`` part."""
    found = file_name(name, adapter)
    return found if found is not None else ".".join(part for part in name.split(".") if part != adapter)


#: Keys whose dicts PEFT writes in their own order, not sorted (``peft.config.CONFIG_KEYS_WITH_PRESERVED_ORDER``).
PEFT_PRESERVED_ORDER = frozenset({"rank_pattern", "alpha_pattern", "paca_indices_pattern"})


def peft_config_text(config: dict[str, Any]) -> str:
    """``adapter_config.json``'s text byte for byte as PEFT's ``save_pretrained`` writes it: keys
    sorted at every level except inside :data:`PEFT_PRESERVED_ORDER`, indented by 2, ASCII, and no
    newline at the end."""

    def ordered(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v if k in PEFT_PRESERVED_ORDER else ordered(v) for k, v in sorted(value.items())}
        if isinstance(value, (list, tuple)):
            return [ordered(item) for item in value]
        return value

    return json.dumps(ordered(config), indent=2)


def export_peft(
    transport: Transport,
    run_id: str,
    ref: int | str,
    directory: Path,
    *,
    config: dict[str, Any] | None = None,
    adapter: str = "default",
    keys: Sequence[str] | None = None,
) -> ExportResult:
    """Write version ``ref``'s adapter to ``directory`` as a PEFT adapter folder."""
    started = time.perf_counter()
    manifest = transport.manifest(run_id, ref)
    if config is None:
        by_adapter = stored_json(manifest, "peft_configs")
        found = by_adapter.get(adapter) if isinstance(by_adapter, dict) else None
        if found is None:
            found = stored_json(manifest, "peft_config")
        if not isinstance(found, dict):
            raise InvalidInputError(
                f"version {manifest.version} of {run_id!r} holds no extra['peft_config']; pass the adapter's "
                "adapter_config.json (--peft-config)"
            )
        config = found
    entries = {e.key: e for e in manifest.tensors}
    if keys is None:  # what PEFT's save_pretrained writes of this adapter
        stored = selection.selected_model_keys(manifest, None)
        items = [(found, entries[stored[name]]) for name, found in export_names(stored, adapter).items()]
    else:
        selected = selection.selected_model_keys(manifest, selection.check_patterns(list(keys)))
        items = [(peft_file_name(name, adapter), entries[key]) for name, key in selected.items()]
    if not items:
        raise StateMismatchError(
            f"version {manifest.version} of {run_id!r} holds no tensors of adapter {adapter!r} (LoRA tensors named "
            f"'….lora_A.{adapter}.weight' or modules_to_save copies); choose them with --keys"
        )
    if len({name for name, _ in items}) != len(items):
        raise StateMismatchError(f"the adapter's tensors do not have distinct names once {adapter!r} is dropped")
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / ADAPTER_FILE, items, TensorReader(transport, manifest), FILE_METADATA)
    write_text_atomically(directory / ADAPTER_CONFIG, peft_config_text(config))
    return ExportResult(
        run_id=manifest.run_id,
        version=manifest.version,
        directory=directory,
        files=[ADAPTER_FILE, ADAPTER_CONFIG],
        tensors=len(items),
        bytes=sum(e.nbytes for _, e in items),
        seconds=time.perf_counter() - started,
    )


def export_dcp(transport: Transport, run_id: str, ref: int | str, directory: Path) -> ExportResult:
    """Write version ``ref`` to ``directory`` as a DCP checkpoint (``model`` and, if stored, ``optim``;
    a version imported from a torchtitan or torchtune folder in that framework's layout,
    :func:`~client.formats.dcp_layouts.written_layout`).

    Raises:
        OSError: a file or folder in ``directory`` could not be written (as itself, not inside
            torch's CheckpointException).
        StorageError: the save failed otherwise.
    """
    started = time.perf_counter()
    manifest = transport.manifest(run_id, ref)
    reader = TensorReader(transport, manifest)
    cpu = torch.device("cpu")
    model, _ = restore.materialize_model(reader, selection.selected_model_keys(manifest, None), cpu, None)
    state: dict[str, Any] = {"model": model}
    saved_optim: Any = manifest.state.get("optim")
    if isinstance(saved_optim, dict) and is_positional(saved_optim["param_groups"]):
        raise StateMismatchError(
            f"version {manifest.version} of run {manifest.run_id!r} holds optimizer state by position (its source "
            "numbered the parameters), and a DCP checkpoint keys it by name: load it with client.load(run, "
            "model=..., optim=...) and store it with client.save, then export that version"
        )
    on_cpu = {e.param: cpu for e in manifest.tensors if e.param is not None}
    optim = restore.restore_section(reader, "optim", cpu, on_cpu)
    if optim is not None:
        state["optim"] = optim
    extra = restore.restore_section(reader, "extra", cpu)
    scheduler = restore.restore_section(reader, "scheduler", cpu)
    framework = written_layout(model, optim, scheduler, extra if isinstance(extra, dict) else {})
    _save_dcp(framework if framework is not None else state, directory)
    tensors = [e for e in manifest.tensors if e.key.startswith(("model/", "optim/"))]
    return ExportResult(
        run_id=manifest.run_id,
        version=manifest.version,
        directory=directory,
        files=sorted(p.name for p in directory.iterdir()),
        tensors=len(tensors),
        bytes=sum(e.nbytes for e in tensors),
        seconds=time.perf_counter() - started,
    )


def _save_dcp(state: dict[str, Any], directory: Path) -> None:
    """``dcp.save`` in this one process, without torch's notices of a single-process save
    (:data:`DCP_NOTICES`, silenced for this call only); the error that stopped the save is raised
    as itself (a file-system or ckptstore error) rather than inside torch's CheckpointException."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            for notice in DCP_NOTICES:
                warnings.filterwarnings("ignore", message=notice, category=UserWarning)
            dcp.save(state, checkpoint_id=directory, no_dist=True)
    except CheckpointException as exc:
        causes = [cause for cause, _ in exc.failures.values()]
        if causes and isinstance(causes[0], (OSError, CheckpointError)):
            raise causes[0] from exc
        why = f": {type(causes[0]).__name__}: {causes[0]}" if causes else ""
        raise StorageError(f"writing the DCP folder {directory} failed{why}") from exc
