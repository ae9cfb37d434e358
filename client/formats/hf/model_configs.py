"""The configs beside a Hugging Face model's weights, kept by an import and written back by an export.

``save_pretrained`` writes ``config.json`` (what model it is) and, for a model that generates,
``generation_config.json`` (its sampling settings: ``temperature``, ``top_p``,
``max_new_tokens``...). An import of a ``save_pretrained`` or ``Trainer`` folder keeps each as
JSON in the version's extras (``model_config``, ``generation_config``), the keys ``client.save``
records for a transformers model (:mod:`client.integrations.model_configs`), and ``ckptstore
export`` writes them back, so ``AutoModel*.from_pretrained(export_dir)`` loads the model with
its generation settings and nothing copied by hand.

Each file is untrusted input: at most :data:`MAX_CONFIG_BYTES`, strict JSON (UTF-8, no duplicate
keys, no NaN), a JSON object. It is kept as data; nothing in it is run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptstore.client.formats import confined
from ckptstore.client.formats.json_text import parse_json
from ckptstore.service.errors import InvalidInputError

MAX_CONFIG_BYTES = 10 << 20
#: Each config file of a folder, with the key of a version's ``extra`` that holds it.
CONFIG_FILES = {"config.json": "model_config", "generation_config.json": "generation_config"}


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling link or a FIFO included (the reader then refuses it by name)."""
    return os.path.lexists(path)


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in the config file at ``path``.

    Raises:
        InvalidInputError: too large, not strict JSON, or not an object (the message names the file).
    """
    config = parse_json(confined.read_small(path, MAX_CONFIG_BYTES), str(path), floats=True)
    if not isinstance(config, dict):
        raise InvalidInputError(f"{path}: not a JSON object")
    return config


def read_configs(directory: Path) -> dict[str, Any]:
    """Each config file ``directory`` holds (:data:`CONFIG_FILES`), by its ``extra`` key."""
    return {key: read_config(directory / name) for name, key in CONFIG_FILES.items() if exists(directory / name)}
