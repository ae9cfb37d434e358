"""Building a Store from settings: the database from its URL, the blob store from its URL.

:func:`service.settings.local_settings` and :func:`open_store` are the one place that decides which store a
process opens when it reaches the store itself rather than through a server: ``ckptstore
serve``, every ``ckptstore`` command run without ``CKPTSTORE_URL``, and ``Client()`` without
a URL all read ``CKPTSTORE_DATABASE_URL`` and ``CKPTSTORE_BLOBS`` (else the embedded store in
``CKPTSTORE_HOME``) the same way.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from ckptstore.service.blobs import BlobStore, LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.reserve import SpaceReserve
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.secrets_mask import mask_url
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

#: Where a store can be named from; quoted by every refusal to open one that is not there.
WHERE_TO_POINT = (
    "set CKPTSTORE_URL to a ckptstore server (http://host:8000), or CKPTSTORE_DATABASE_URL and "
    "CKPTSTORE_BLOBS to the server's database and blob store, or CKPTSTORE_HOME to the folder of an "
    "embedded store"
)


def open_blob_store(url: str, settings: Settings) -> BlobStore:
    """A blob store for ``file:///path`` or ``s3://bucket/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalBlobStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        from ckptstore.service.blobs.s3 import S3BlobStore

        return S3BlobStore(
            parsed.netloc,
            parsed.path.strip("/"),
            part_bytes=settings.s3_part_bytes,
            checksum=settings.s3_checksum,
        )
    raise InvalidInputError(f"CKPTSTORE_BLOBS must be file:///path or s3://bucket/prefix, not {mask_url(url)!r}")


def check_store_exists(settings: Settings) -> None:
    """Raise NotFoundError, naming the variables to set, unless the settings name a store that exists.

    An embedded store exists once its ``metadata.db`` does. A server database
    (``CKPTSTORE_DATABASE_URL``) is checked when it is opened: :func:`open_store` with
    ``create=False`` requires its schema to be current, so an empty database is refused too.
    """
    metadata = settings.embedded_database
    if metadata is not None and not metadata.is_file():
        raise NotFoundError(
            f"no checkpoint store here: CKPTSTORE_URL and CKPTSTORE_DATABASE_URL are unset and the embedded "
            f"store folder {settings.home_path} holds none (no metadata.db); {WHERE_TO_POINT}. Nothing was created"
        )


def open_store(settings: Settings | None = None, *, require_current_schema: bool = False, create: bool = True) -> Store:
    """The store the settings describe (embedded defaults under ``home``).

    With ``require_current_schema``, a server database that is not at the latest migration
    raises StorageError naming ``ckptstore db upgrade``; the embedded SQLite file always
    upgrades itself.

    With ``create=False`` (commands that read, check or collect) nothing is created: an
    embedded store that does not exist yet raises NotFoundError naming the variables to set
    (:func:`check_store_exists`), and a server database must be at the current schema.
    """
    settings = settings or Settings()
    if not create:
        check_store_exists(settings)
        require_current_schema = True
    # A SQLite file keeps a reserve of disk for cleanup; on a full disk it is released before
    # opening, or SQLite could not even read (service.db.reserve).
    reserve = SpaceReserve.for_database(settings.resolved_database_url, settings.reserve_bytes)
    if reserve is not None:
        reserve.on_opening()
    if settings.embedded_database is not None:
        database = Database.sqlite_file(settings.embedded_database)
    else:
        database = Database(settings.resolved_database_url)
        if require_current_schema:
            from ckptstore.service.db.schema import require_current

            try:
                require_current(database)
            except BaseException:
                database.dispose()
                raise
    try:
        blobs = open_blob_store(settings.resolved_blobs, settings)
    except BaseException:
        database.dispose()
        raise
    direct, deltas = settings.direct_writes, settings.deltas_per_keyframe
    staging = settings.staging_dir
    return Store(database, blobs, staging, direct_writes=direct, deltas_per_keyframe=deltas, reserve=reserve)
