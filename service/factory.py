"""Building a Store from settings: the database from its URL, the blob store from its URL."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from service.blobs import BlobStore, LocalBlobStore
from service.db import Database
from service.errors import InvalidInputError
from service.settings import Settings
from service.store import Store


def open_blob_store(url: str, settings: Settings) -> BlobStore:
    """A blob store for ``file:///path`` or ``s3://bucket/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalBlobStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        from service.blobs.s3 import S3BlobStore

        return S3BlobStore(
            parsed.netloc,
            parsed.path.strip("/"),
            part_bytes=settings.s3_part_bytes,
            checksum=settings.s3_checksum,
        )
    raise InvalidInputError(f"CKPTSTORE_BLOBS must be file:///path or s3://bucket/prefix, not {url!r}")


def open_store(settings: Settings | None = None, *, require_current_schema: bool = False) -> Store:
    """The store the settings describe (embedded defaults under ``home``).

    With ``require_current_schema``, a server database that is not at the latest migration
    raises StorageError naming ``ckptstore db upgrade``; the embedded SQLite file always
    upgrades itself.
    """
    settings = settings or Settings()
    home = settings.home_path
    home.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    if settings.database_url is None:
        database = Database.sqlite_file(home / "metadata.db")
    else:
        database = Database(url)
        if require_current_schema:
            from service.db.schema import require_current

            require_current(database)
    blobs = open_blob_store(settings.resolved_blobs, settings)
    return Store(database, blobs, settings.staging_dir, direct_writes=settings.direct_writes)
