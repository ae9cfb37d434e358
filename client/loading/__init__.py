"""The load path: which bytes a load reads, in what order, verified, and where they land.

- :mod:`.selection`: which stored keys a load (or a ``keys=`` subset) takes;
- :mod:`.plan`, :mod:`.readahead`: reads grouped by shard and run ahead of their use;
- :mod:`.reader`: tensors read and verified against their digests as they arrive;
- :mod:`.decoding`, :mod:`.read_hints`: tensors stored encoded, decoded on every core, their
  payloads announced to the store a window ahead;
- :mod:`.restore`: bytes into a model's parameters, an optimizer's state (placement rules)
  and the scheduler and extras;
- :mod:`.verify`: every stored byte of a version checked (``ckptstore verify``).

May import torch, the top of ``client`` (tensors, transport, names, keys, placement,
jsonstate) and ``service`` (errors, format, records); never ``client.saving``, ``client.http``,
``client.formats`` or the packages above it.
"""
