"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) as named state.

The folder is what ``PeftModel.save_pretrained`` and ``ckptstore export --format peft`` write:
the adapter's tensors under PEFT's file names, which leave out the adapter's name. An import
stores them under the names a PeftModel's ``state_dict`` uses, the adapter called ``default``
(:mod:`.peft_names`: ``…q_proj.lora_A.weight`` becomes ``…q_proj.lora_A.default.weight``, DoRA's
``…lora_magnitude_vector`` becomes ``…lora_magnitude_vector.default.weight``, a ``modules_to_save``
copy ``…lm_head.weight`` becomes ``…lm_head.modules_to_save.default.weight``, and the embedding
layers PEFT saves beside LoRA on them keep their names), and the config as
``extra["peft_config"]``, the JSON ``export --format peft`` writes back. So the version is what
the Trainer plug-in stores of a PEFT model, less its frozen base: the adapter tensors are stored
as trainable (they are what training changes), with no optimizer state.

Load it into a PeftModel built on its base model with ``client.load(run, model=peft_model,
keys=[...])``, the patterns selecting what the adapter holds (``"*lora_*"``, and
``"*.modules_to_save.*"`` for its copies): strict for those (every selected tensor of the model
must be in the version, with its shape), the base left as it is.

Only LoRA adapters are read (``peft_type`` ``"LORA"``); a tensor that is none of the kinds above
(another PEFT method's, a bias, a ``trainable_token_indices`` delta) is refused by name, as is a
pickled ``adapter_model.bin``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats import confined
from ckptstore.client.formats.hf.peft_names import DEFAULT_ADAPTER, LORA_PREFIX, MODULES_TO_SAVE, model_names
from ckptstore.client.formats.json_text import parse_json
from ckptstore.client.formats.sources import Imported, exists
from ckptstore.service.errors import InvalidInputError

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PICKLED_ADAPTER_FILE = "adapter_model.bin"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: Where the import keeps the adapter's tensors (named as the model names them) in ``Imported.tree``.
WEIGHTS_KEY = "state_dict"

SafetensorsOpener = Callable[[Path], dict[str, torch.Tensor]]


def state_dict_name(file_name: str, adapter: str = DEFAULT_ADAPTER) -> str:
    """The PeftModel ``state_dict`` name of a LoRA tensor PEFT saved as ``file_name``.

    The adapter's name goes after the ``lora_*`` part (``lora_A.weight`` → ``lora_A.default.weight``;
    ``lora_embedding_A`` → ``lora_embedding_A.default``; ``lora_magnitude_vector`` →
    ``lora_magnitude_vector.default.weight``), as ``peft`` inserts it when loading.
    """
    found = model_names([file_name], (), adapter)[file_name]
    if found is None:
        raise ValueError(f"{file_name!r} holds no {LORA_PREFIX!r} part")
    return found


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """The LoRA config in ``directory``'s ``adapter_config.json``, as JSON.

    Raises:
        InvalidInputError: too large, not a JSON object, or not a LoRA config.
    """
    path = directory / ADAPTER_CONFIG
    config = parse_json(confined.read_small(path, MAX_ADAPTER_CONFIG_BYTES), str(path), floats=True)
    if not isinstance(config, dict):
        raise InvalidInputError(f"{path}: not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InvalidInputError(
            f"{path}: peft_type {str(peft_type)[:40]!r}; ckptstore imports LoRA adapters (peft_type 'LORA') only"
        )
    saved = config.get(MODULES_TO_SAVE)
    if saved is not None and not (isinstance(saved, list) and all(isinstance(m, str) and m for m in saved)):
        raise InvalidInputError(f"{path}: {MODULES_TO_SAVE} is not a list of module names")
    return config


def read_peft_folder(directory: Path, open_safetensors: SafetensorsOpener) -> Imported:
    """A PEFT LoRA adapter folder: its tensors under PeftModel names and its config.

    ``open_safetensors`` reads (and checks) the adapter's safetensors file: the importer's own
    reader, handed in so this module does not import the importer.

    Raises:
        InvalidInputError: the config or the tensors are refused (the message names the file).
    """
    config = read_adapter_config(directory)
    path = directory / ADAPTER_FILE
    if not exists(path):
        found = " (it holds adapter_model.bin, a pickle: save with safe_serialization=True)"
        raise InvalidInputError(
            f"{directory} has {ADAPTER_CONFIG} but no {ADAPTER_FILE}"
            f"{found if exists(directory / PICKLED_ADAPTER_FILE) else ''}"
        )
    stored = open_safetensors(path)
    names = model_names(stored, config.get(MODULES_TO_SAVE) or ())
    tensors: dict[str, torch.Tensor] = {}
    for file_name, tensor in stored.items():
        name = names[file_name]
        if name is None:
            raise InvalidInputError(
                f"{path}: tensor {file_name[:80]!r} is not a LoRA tensor (no {LORA_PREFIX!r} part in its name), "
                f"a copy of a module the config's {MODULES_TO_SAVE} names, nor the base layer of a module the "
                "adapter adapts; ckptstore imports those of a LoRA adapter only"
            )
        if name in tensors:
            raise InvalidInputError(f"{path}: two tensors would both be named {name[:80]!r}")
        tensors[name] = tensor
    if not tensors:
        raise InvalidInputError(f"{path} holds no tensors")
    # Stored as the Trainer plug-in stores a PEFT model's adapter: trainable, the config beside it.
    return Imported(tensors, tree={WEIGHTS_KEY: tensors, "peft_config": config}, weights_key=WEIGHTS_KEY)
