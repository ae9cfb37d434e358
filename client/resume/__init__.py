"""What a resume needs besides the model, the optimizer and the scheduler.

- :mod:`.rng`: the random number generators (Python's ``random``, NumPy's global state, torch's
  CPU generator and every CUDA device's) as tensors and JSON;
- :mod:`.section`: a version's ``resume`` section: the generators, recorded by every
  :meth:`client.api.Client.save` unless asked not to, and the state of objects with
  ``state_dict`` / ``load_state_dict`` the caller names (a torchdata ``StatefulDataLoader``), and
  when and how :meth:`client.api.Client.load` puts them back.

May import torch, numpy, the top of ``client`` (state, jsonstate) and ``service`` (errors, format);
never ``client.saving``, ``client.loading`` or the packages above them (the Client decodes the
section and hands it here).
"""
