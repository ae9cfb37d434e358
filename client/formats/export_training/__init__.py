"""Export a version as a training checkpoint another tool resumes from: leaving with everything.

- :mod:`.pt`: one ``torch.save`` file, ``{"model", "optimizer", "lr_scheduler", "step", ...extras}``,
  the layout ``ckptstore import`` reads back;
- :mod:`.lightning`: a Lightning ``.ckpt`` that ``Trainer.fit(ckpt_path=...)`` resumes from;
- :mod:`.trainer`: a Hugging Face ``Trainer`` ``checkpoint-N`` folder that
  ``train(resume_from_checkpoint=...)`` accepts.

:mod:`.version_state` reads a version's whole state into memory (every byte verified) with the
optimizer in torch's own layout (positions in the groups' order); :mod:`.torch_file` is the one
writer of pickled files in the product, and writes plain data only (tensors, dicts, lists,
tuples, numbers, strings; numpy arrays of RNG state where the target tool reads them), so every
file it writes loads with ``torch.load`` and ``weights_only=True``.

May import torch, numpy, :mod:`ckptstore.client.loading`, :mod:`ckptstore.client.formats` and
``ckptstore.service``; nothing here imports ``client.http`` or ``client.saving``.
"""
