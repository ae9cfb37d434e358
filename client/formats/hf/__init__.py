"""Hugging Face folders: PEFT adapter folders and the model configs beside a model's weights.

- :mod:`.peft_folder`: an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
  read as named state;
- :mod:`.peft_names`: PEFT's file names and a PeftModel's ``state_dict`` names, both ways (LoRA,
  DoRA's magnitude vectors, LoRA on embeddings and the layers saved beside it, ``modules_to_save``);
- :mod:`.model_configs`: ``config.json`` and ``generation_config.json`` of a folder, kept as a
  version's extras and written back on export.

May import torch, :mod:`client.formats`' floor (``confined``, ``json_text``, ``sources``) and
``ckptstore.service`` errors; never transformers or peft (a folder is read as JSON and tensors).
"""
