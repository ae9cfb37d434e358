"""DCP checkpoint folders (``.metadata`` + ``*.distcp``), read by this code from the metadata's offsets.

- :mod:`.folder`: the metadata read as plain records, every claim checked before a byte of data is
  read, then each item read once;
- :mod:`.cover`: the checks on the layout: chunks cover each tensor exactly once, and no stored
  region is read twice.

May import torch, :mod:`ckptstore.client.formats.pickled`, :mod:`ckptstore.client.formats.torch_save`,
the floor modules :mod:`~ckptstore.client.formats.confined` and
:mod:`~ckptstore.client.formats.budget`, and ``ckptstore.service.errors``.
"""
