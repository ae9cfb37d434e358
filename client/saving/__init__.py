"""The save path: what a save stores and how its bytes reach the store.

- :mod:`.plan`: which tensors go in which shard (torch-free, on plain sizes);
- :mod:`.background`: background saves (``blocking=False``), one at a time, on the client's
  thread or in a save process (:mod:`.save_process`, staging into :mod:`.shared_staging`), which
  ``auto`` starts once the saves come often (:mod:`.cadence`);
- :mod:`.snapshot`, :mod:`.packed_staging`: the state copied into staging buffers, accelerator
  tensors gathered on their device and moved in one transfer;
- :mod:`.hashing`: digests, the frozen-tensor cache and the ledger of what a save may skip;
- :mod:`.upload`, :mod:`.shards`, :mod:`.gather`: shards written and sent through the transport,
  small tensors' bytes gathered into one copy;
- :mod:`.saver`: one save run, from flattened state to a committed version.

May import torch, the top of ``client`` (state, tensors, transport, connection, results, progress) and
``service`` (errors, format, records); never ``client.loading``, ``client.http``,
``client.formats`` or the packages above it.
"""
