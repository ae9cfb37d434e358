"""PEFT's names for an adapter's tensors, and a PeftModel's ``state_dict`` names for them, both ways.

``PeftModel.save_pretrained`` writes an adapter's tensors without the adapter's name, and a
PeftModel's ``state_dict`` holds them with it; PEFT 0.22 maps them so (``get_peft_model_state_dict``
and ``set_peft_model_state_dict``), and so does ckptstore, without building the model:

- LoRA: ``…q_proj.lora_A.weight`` in ``adapter_model.safetensors``, ``…q_proj.lora_A.default.weight``
  in the model's ``state_dict``;
- LoRA on an embedding: ``…embed_tokens.lora_embedding_A``, ``…embed_tokens.lora_embedding_A.default``;
- DoRA's magnitudes: ``…q_proj.lora_magnitude_vector``, ``…q_proj.lora_magnitude_vector.default.weight``;
- a ``modules_to_save`` copy: ``…lm_head.weight``, ``…lm_head.modules_to_save.default.weight``;
- an adapted layer's base: ``…embed_tokens.base_layer.weight``, the same name in both.

The last is what PEFT saves beside LoRA on an embedding layer (``save_embedding_layers``):
the layer's own weights. A ``modules_to_save`` module's ``original_module`` copy is the base
model's and is never part of an adapter file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: The adapter name a PeftModel gives the adapter it loads unless told otherwise.
DEFAULT_ADAPTER = "default"
#: What starts the name of a LoRA tensor's part (PEFT's parameter prefix for LoRA).
LORA_PREFIX = "lora_"
#: DoRA's per-output magnitudes: a module in the model (``….default.weight``), a bare name in the file.
MAGNITUDE = "lora_magnitude_vector"
MODULES_TO_SAVE = "modules_to_save"
BASE_LAYER = "base_layer"
#: The layers PEFT saves whole beside LoRA on an embedding (peft's ``EMBEDDING_LAYER_NAMES``).
EMBEDDING_LAYERS = ("embed_tokens", "lm_head")
#: What a PeftModel's names start with: the model under the adapter is ``base_model.model``.
PEFT_PREFIX = ("base_model", "model")


def _lora_part(parts: Sequence[str]) -> int | None:
    """The index of the last ``lora_*`` part of a dotted name (never its first part), or None."""
    for index in range(len(parts) - 1, 0, -1):
        if parts[index].startswith(LORA_PREFIX):
            return index
    return None


def matches_module(module: str, target: str) -> bool:
    """Whether ``target`` (an entry of ``modules_to_save``) names the module ``module``, as PEFT
    matches them: the whole name, or its last dotted parts."""
    return module == target or module.endswith("." + target)


def saved_module(file_name: str, modules_to_save: Sequence[str]) -> str | None:
    """The module of a ``modules_to_save`` entry a file tensor belongs to (the shortest matching
    prefix of its name below the PeftModel's ``base_model.model``), or None."""
    parts = file_name.split(".")
    first = len(PEFT_PREFIX) if parts[: len(PEFT_PREFIX)] == list(PEFT_PREFIX) else 0
    for end in range(first + 1, len(parts)):
        module = ".".join(parts[first:end])
        if any(matches_module(module, target) for target in modules_to_save):
            return ".".join(parts[:end])
    return None


def model_names(
    file_names: Iterable[str], modules_to_save: Sequence[str], adapter: str = DEFAULT_ADAPTER
) -> dict[str, str | None]:
    """Each file name of an adapter's tensors with its PeftModel ``state_dict`` name, or None for a
    tensor that is none of the kinds this module maps (the caller refuses it by name)."""
    names = list(file_names)
    adapted = set()
    for name in names:
        parts = name.split(".")
        index = _lora_part(parts)
        if index is not None:
            adapted.add(".".join(parts[:index]))
    found: dict[str, str | None] = {}
    for name in names:
        parts = name.split(".")
        index = _lora_part(parts)
        module = saved_module(name, modules_to_save)
        if index is not None:
            if parts[index] == MAGNITUDE and index == len(parts) - 1:
                found[name] = f"{name}.{adapter}.weight"
            else:
                found[name] = ".".join([*parts[: index + 1], adapter, *parts[index + 1 :]])
        elif module is not None:
            found[name] = f"{module}.{MODULES_TO_SAVE}.{adapter}.{name[len(module) + 1 :]}"
        elif BASE_LAYER in parts and ".".join(parts[: parts.index(BASE_LAYER)]) in adapted:
            found[name] = name
        else:
            found[name] = None
    return found


def file_name(model_name: str, adapter: str = DEFAULT_ADAPTER) -> str | None:
    """The name PEFT writes for a PeftModel ``state_dict`` name of adapter ``adapter``'s tensors, or
    None when the name is no tensor of that adapter (another adapter's, the base model's)."""
    parts = model_name.split(".")
    index = _lora_part(parts)
    if index is not None:
        if index + 1 >= len(parts) or parts[index + 1] != adapter:
            return None
        kept = parts[: index + 1] + parts[index + 2 :]
        if parts[index] == MAGNITUDE and kept[-1] == "weight" and len(kept) == index + 2:
            kept = kept[:-1]
        return ".".join(kept)
    for at in range(1, len(parts) - 2):
        if parts[at] == MODULES_TO_SAVE:
            if parts[at + 1] != adapter:
                return None
            return ".".join(parts[:at] + parts[at + 2 :])
    return None


def export_names(model_names_: Iterable[str], adapter: str = DEFAULT_ADAPTER) -> dict[str, str]:
    """The tensors ``PeftModel.save_pretrained`` would write for adapter ``adapter`` of a model
    whose ``state_dict`` names are ``model_names_``: model name -> file name.

    Its LoRA (and DoRA) tensors and ``modules_to_save`` copies, and, when the adapter holds LoRA
    on an embedding layer, the base weights of its adapted embedding layers (PEFT's
    ``save_embedding_layers="auto"``).
    """
    names = list(model_names_)
    chosen = {name: found for name in names if (found := file_name(name, adapter)) is not None}
    if any(".lora_embedding_" in name for name in chosen):
        for name in names:
            parts = name.split(".")
            if BASE_LAYER not in parts:
                continue
            module = ".".join(parts[: parts.index(BASE_LAYER)])
            if module.rsplit(".", 1)[-1] in EMBEDDING_LAYERS and _adapted(module, chosen):
                chosen[name] = name
    return chosen


def _adapted(module: str, chosen: dict[str, str]) -> bool:
    """Whether a LoRA tensor of ``module`` is among the chosen tensors."""
    return any(name.startswith(f"{module}.{LORA_PREFIX}") for name in chosen)
