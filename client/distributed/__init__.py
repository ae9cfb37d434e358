"""Multi-rank checkpoints: ckptstore as the storage of ``torch.distributed.checkpoint``.

- :class:`StoreWriter` / :class:`StoreReader`: a ``StorageWriter`` / ``StorageReader`` pair,
  so ``dcp.save(sd, storage_writer=StoreWriter("run"))`` and ``dcp.load(sd,
  storage_reader=StoreReader("run"))`` (and ``dcp.async_save``) store into a run.
- ``client.save`` / ``client.load`` of an FSDP2 or DTensor model go through them
  (:mod:`client.distributed.training`).

Importing this package imports ``torch.distributed.checkpoint``; ``client`` itself does so
only when a sharded model is saved or loaded.

May import torch (``torch.distributed``), the top of ``client``, ``client.saving``,
``client.loading`` and ``service``; never the ``client`` package itself nor ``client.api``
(which imports this package to save and load sharded models): it takes any client through the
:class:`client.distributed.clients.StoreClient` protocol.
"""

from ckptstore.client.distributed.reader import StoreReader
from ckptstore.client.distributed.writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter"]
