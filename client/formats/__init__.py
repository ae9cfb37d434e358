"""Reading the checkpoint files users arrive with, as untrusted input.

Every byte here comes from a file someone else made. The modules:

- :mod:`client.formats.confined`: paths a source names, resolved inside its folder, regular
  files only, every offset and length checked against the file's size before it is read;
- :mod:`client.formats.pickle_reader`: the one reader of pickled bytes, an allow-list
  interpreter that calls nothing but the constructors it is handed and is bounded while it
  reads (bytes, objects, memo, and the value's size and depth as a tree);
- :mod:`client.formats.torch_files`: ``torch.save`` files (zip and legacy) and the
  constructors their pickles may name (tensors over the file's own bytes, numpy arrays of RNG
  state), with every tensor checked against the bytes behind it;
- :mod:`client.formats.dcp_folder`: DCP folders, read from the metadata's offsets by this
  code (never through a planner), each tensor covered by its chunks exactly once.

May import torch, numpy (for RNG state), ``service.errors`` and ``service.format``; nothing
else of the client.
"""
