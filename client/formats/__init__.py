"""Foreign checkpoint files in and out: ``ckptstore import`` and ``ckptstore export``.

- :mod:`.importing` / :mod:`.sources`: what an import stores from each format (safetensors,
  Hugging Face folders, ``torch.save`` files, Lightning, Trainer and DCP folders);
- :mod:`.exporting` / :mod:`.export_formats`: a version written as Hugging Face safetensors,
  a PEFT adapter folder or a DCP folder;
- :mod:`.accelerate`: Accelerate ``save_state`` folders, read whole and written back;
  :mod:`.dcp_layouts`: the layouts torchtitan and torchtune give a DCP folder's state dict.

Every byte an import reads comes from a file someone else made; the readers below treat it
as untrusted input:

- :mod:`client.formats.confined`: paths a source names, resolved inside its folder, regular
  files only, every offset and length checked against the file's size before it is read;
- :mod:`client.formats.pickled.reader`: the one reader of pickled bytes, an allow-list
  interpreter that calls nothing but the constructors it is handed (:mod:`.pickled.allowlist`) and
  is bounded while it reads (bytes, objects, memo), then measures the value's size and depth
  as a tree before anything walks it (:mod:`.pickled.tree`);
- :mod:`client.formats.torch_save.files`: ``torch.save`` files (zip and legacy), read with the
  constructors their pickles may name (:mod:`.torch_save.constructors`: tensors over the file's own
  bytes, checked against them; numpy arrays of RNG state);
- :mod:`client.formats.json_text`: the JSON files of a folder, parsed strictly;
- :mod:`client.formats.dcp.folder`: DCP folders, read from the metadata's offsets by this
  code (never through a planner), each tensor covered by its chunks exactly once.

The readers live in three rooms, one per kind of untrusted bytes (``pickled/``, ``torch_save/``,
``dcp/``), beside the floor that reads folders and files (``confined``, ``budget``,
``json_text``, ``sources``, ``torch_dicts``, ``lightning_ckpt``), and Hugging Face folders
(PEFT adapters, model configs) in ``hf/``. The readers
may import torch, numpy (for RNG state), ``ckptstore.service.errors`` and
``ckptstore.service.format`` only. Import and export also use the Client (:mod:`client.api`),
the load path (:mod:`client.loading`) and the top of ``client``; nothing here imports
``client.http`` or ``client.saving``.
"""
