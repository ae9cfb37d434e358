"""``torch.save`` files (zip archives and the legacy format) read without ``torch.load``.

- :mod:`.files`: the archive or legacy file, its pickle read by :mod:`..pickled` with the
  constructors of :mod:`.constructors`;
- :mod:`.constructors`: tensors over the file's own storages (checked against them, charged to the
  import's budget), numpy arrays of RNG state, ``OrderedDict`` and the other names ``torch.save``
  writes;
- :mod:`.zip_members`: where each zip member lies; members must be distinct, non-overlapping regions.

May import torch, numpy, :mod:`ckptstore.client.formats.pickled`, the floor modules
:mod:`~ckptstore.client.formats.confined` and :mod:`~ckptstore.client.formats.budget`, and
``ckptstore.service.errors`` / ``ckptstore.service.format``.
"""
