"""Accelerate ``save_state`` folders, both ways.

- :mod:`.folder`: a folder ``Accelerator.save_state`` wrote, read whole (weights, optimizer by
  position, schedulers, generators, registered objects, data loader state) in the layout the
  Accelerate plug-in (:mod:`client.integrations.accelerate`) stores a version in;
- :mod:`.export`: a version written as such a folder, which ``Accelerator.load_state`` resumes.

May import torch, numpy, :mod:`client.formats`' floor (``sources``, ``torch_dicts``,
``exporting``), its ``torch_save`` reader and ``export_training.torch_file`` writer,
:mod:`client.loading` and ``ckptstore.service``; never the ``accelerate`` library (a folder is
read as tensors and plain data).
"""
