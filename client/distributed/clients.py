"""What the sharded path needs of a client, so that it never imports :mod:`client.api`.

:class:`client.Client` is such a client; with none given, :class:`~client.distributed.StoreWriter`
and :class:`~client.distributed.StoreReader` take the process's default one, which the
``client`` package provides to :func:`client.connection.default_connection` when imported.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ckptstore.client.connection import default_connection
from ckptstore.client.saving.hashing import SaveLedger
from ckptstore.client.saving.saver import SaveSettings
from ckptstore.client.store_protocol import Transport


@runtime_checkable
class StoreClient(Protocol):
    """A client the sharded path saves and loads through (:class:`client.Client` is one)."""

    @property
    def transport(self) -> Transport:
        """The store saved to and loaded from."""
        ...

    @property
    def read_threads(self) -> int:
        """Reads a load runs at once through :attr:`transport`."""
        ...

    def save_settings(self, ledger: SaveLedger) -> SaveSettings:
        """What a save writes to and with, committing against ``ledger``."""
        ...


def default_store_client() -> StoreClient:
    """The process's default client (:func:`client.default_client`), from the environment."""
    found = default_connection()
    if not isinstance(found, StoreClient):
        raise TypeError(f"the default client is a {type(found).__name__}, which cannot save or load tensors")
    return found
