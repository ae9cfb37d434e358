"""Building a Store from settings: the database from its URL, the blob store from its URL.

:func:`local_settings` and :func:`open_store` are the one place that decides which store a
process opens when it reaches the store itself rather than through a server: ``ckptstore
serve``, every ``ckptstore`` command run without ``CKPTSTORE_URL``, and ``Client()`` without
a URL all read ``CKPTSTORE_DATABASE_URL`` and ``CKPTSTORE_BLOBS`` (else the embedded store in
``CKPTSTORE_HOME``) the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from service.blobs import BlobStore, LocalBlobStore
from service.db import Database
from service.errors import InvalidInputError, NotFoundError
from service.settings import DEFAULT_HOME, Settings
from service.store import Store

#: Where a store can be named from; quoted by every refusal to open one that is not there.
WHERE_TO_POINT = (
    "set CKPTSTORE_URL to a ckptstore server (http://host:8000), or CKPTSTORE_DATABASE_URL and "
    "CKPTSTORE_BLOBS to the server's database and blob store, or CKPTSTORE_HOME to the folder of an "
    "embedded store"
)
#: Settings whose empty value means "unset" (``CKPTSTORE_HOME=`` is not the current folder).
_BLANK_MEANS_UNSET = {"home": "CKPTSTORE_HOME", "database_url": "CKPTSTORE_DATABASE_URL", "blobs": "CKPTSTORE_BLOBS"}


def local_settings(home: Path | str | None = None) -> Settings:
    """The settings of a process that opens the store itself.

    With ``home`` given: the embedded store in that folder alone (SQLite and blobs there;
    ``CKPTSTORE_DATABASE_URL`` and ``CKPTSTORE_BLOBS`` are not read). Without: the environment,
    as ``ckptstore serve`` reads it; a variable set to the empty string counts as unset.

    Raises:
        InvalidInputError: a ``CKPTSTORE_*`` variable holds a value the settings refuse.
    """
    try:
        settings = Settings() if home is None else Settings(home=Path(home), database_url=None, blobs=None)
    except ValidationError as exc:
        problems = "; ".join(f"CKPTSTORE_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors())
        raise InvalidInputError(f"a setting is invalid: {problems}") from exc
    if home is not None:
        return settings
    blank = [name for name, variable in _BLANK_MEANS_UNSET.items() if os.environ.get(variable) == ""]
    return settings.model_copy(update={name: DEFAULT_HOME if name == "home" else None for name in blank})


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


def check_store_exists(settings: Settings) -> None:
    """Raise NotFoundError, naming the variables to set, unless the settings name a store that exists.

    An embedded store exists once its ``metadata.db`` does. A server database
    (``CKPTSTORE_DATABASE_URL``) is checked when it is opened: :func:`open_store` with
    ``create=False`` requires its schema to be current, so an empty database is refused too.
    """
    if settings.database_url is not None:
        return
    metadata = settings.home_path / "metadata.db"
    if not metadata.is_file():
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
    if settings.database_url is None:
        database = Database.sqlite_file(settings.home_path / "metadata.db")
    else:
        database = Database(settings.database_url)
        if require_current_schema:
            from service.db.schema import require_current

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
    return Store(database, blobs, settings.staging_dir, direct_writes=settings.direct_writes)
