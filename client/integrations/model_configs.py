"""The configs that describe a Hugging Face model, as JSON, recorded in a version's ``extra``.

``client.save`` and the ``Trainer`` plug-in record them with every version of a transformers or
PEFT model, so ``ckptstore export`` writes folders ``from_pretrained`` loads with nothing copied
by hand:

- ``model_config``: the model's ``config.json`` (every field);
- ``generation_config``: its ``generation_config.json`` (sampling settings such as
  ``temperature``, ``top_p``, ``max_new_tokens``), as ``save_pretrained`` writes it;
- ``peft_config``: a PEFT model's active adapter's ``adapter_config.json``, as
  ``PeftModel.save_pretrained`` writes it, and ``peft_configs``: every adapter's by name, when
  it has several.

No framework is imported here: a model of transformers or peft exists only once its library is
imported, so the library is looked up in ``sys.modules`` (importing the client stays light).
"""

from __future__ import annotations

import json
import sys
from typing import Any

MODEL_CONFIG = "model_config"
GENERATION_CONFIG = "generation_config"
PEFT_CONFIG = "peft_config"
PEFT_CONFIGS = "peft_configs"
#: Every key this module may add to a version's ``extra``.
KEYS = (MODEL_CONFIG, GENERATION_CONFIG, PEFT_CONFIG, PEFT_CONFIGS)


def as_json(value: Any) -> Any:
    """``value`` as plain JSON values: sets become sorted lists (as in a PEFT ``adapter_config.json``)."""

    def plain(item: Any) -> Any:
        if isinstance(item, (set, frozenset)):
            return sorted(item, key=repr)
        raise TypeError(f"a {type(item).__name__} in a config is not JSON")

    return json.loads(json.dumps(value, default=plain))


def model_configs(model: Any) -> dict[str, Any]:
    """The configs that describe ``model`` (see the module's list), as JSON; empty for a model
    that is neither a transformers nor a PEFT model."""
    extras: dict[str, Any] = {}
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        config = getattr(model, "config", None)
        if isinstance(config, transformers.PreTrainedConfig):
            extras[MODEL_CONFIG] = json.loads(config.to_json_string(use_diff=False))
        generation = getattr(model, "generation_config", None)
        if isinstance(generation, transformers.GenerationConfig):
            extras[GENERATION_CONFIG] = json.loads(generation.to_json_string(use_diff=True))
    extras.update(peft_configs(model))
    return extras


def peft_configs(model: Any) -> dict[str, Any]:
    """``peft_config`` (and ``peft_configs`` with several adapters) of a PEFT model, else empty.

    Each adapter's config is what ``PeftModel.save_pretrained`` writes: its fields, sets as
    sorted lists, ``inference_mode`` true, ``base_model_name_or_path`` from the base model when
    the config has none, and ``auto_mapping`` (the base model's class) when it has no task type.
    """
    peft = sys.modules.get("peft")
    adapters = getattr(model, "peft_config", None)
    if peft is None or not isinstance(adapters, dict) or not adapters:
        return {}
    if not all(isinstance(c, peft.PeftConfig) for c in adapters.values()):
        return {}
    base = model.get_base_model() if hasattr(model, "get_base_model") else None
    by_name = {str(name): _adapter_config(c, base) for name, c in adapters.items()}
    active = getattr(model, "active_adapter", None)
    if not isinstance(active, str) or active not in by_name:  # not one adapter by name: the first
        active = next(iter(by_name))
    found: dict[str, Any] = {PEFT_CONFIG: by_name[active]}
    if len(by_name) > 1:
        found[PEFT_CONFIGS] = by_name
    return found


def _adapter_config(config: Any, base: Any) -> dict[str, Any]:
    """One adapter's config as ``adapter_config.json`` holds it (:func:`peft_configs`)."""
    written = as_json(config.to_dict())
    written["inference_mode"] = True
    if written.get("base_model_name_or_path") is None and base is not None:
        written["base_model_name_or_path"] = base.__dict__.get("name_or_path", None) or None
    if written.get("task_type") is None and base is not None:
        written["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return written


def with_model_configs(model: Any, extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """``extra`` with the configs of ``model`` added under the keys it does not set itself."""
    configs = model_configs(model)
    if not configs:
        return extra
    return {**configs, **(extra or {})}
