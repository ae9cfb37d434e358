"""Service settings: every option is also an environment variable ``CKPTSTORE_<NAME>``.

With only ``CKPTSTORE_HOME`` set (or nothing: ``~/.ckptstore``) the store is embedded-style:
SQLite in ``<home>/metadata.db`` and blobs in ``<home>/blobs``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptstore.service.errors import InvalidInputError

DEFAULT_HOME = Path("~/.ckptstore")
#: The embedded store's SQLite file in its home folder.
METADATA_FILE = "metadata.db"


class Settings(BaseSettings):
    """Where the store keeps metadata and blobs, and how the server behaves."""

    model_config = SettingsConfigDict(env_prefix="CKPTSTORE_", extra="ignore")

    home: Path = DEFAULT_HOME
    #: SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host/db``; default SQLite under home.
    database_url: str | None = None
    #: ``file:///path`` or ``s3://bucket/prefix``; default ``<home>/blobs``.
    blobs: str | None = None
    #: Comma-separated ``scope:token`` pairs (scope = read | write | admin).
    tokens: str | None = None
    host: str = "127.0.0.1"
    #: Comma-separated ``Host`` names, besides loopback ones, that a server with no tokens answers
    #: (a name the operator gave 127.0.0.1); any other is refused (:mod:`service.api.http.same_site`).
    allowed_hosts: str | None = None
    port: int = Field(default=8000, ge=0, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    #: boto3 request checksum mode: ``when_required`` keeps MinIO-style stores working.
    s3_checksum: str = "when_required"
    s3_part_bytes: int = Field(default=64 << 20, ge=5 << 20)
    #: Largest shard upload accepted, in bytes.
    max_shard_bytes: int = Field(default=8 << 30, ge=1 << 20)
    #: Write shards around the page cache (O_DIRECT) where the file system allows it; unset:
    #: whichever of direct and buffered writes is faster on the staging folder's disk, measured
    #: once and kept in ``write-mode.json`` there (:mod:`service.intake.write_mode`).
    direct_writes: bool | None = None
    #: Largest commit (manifest) body accepted, in bytes (about 30,000 tensors by default); also
    #: caps every other JSON body. See README "Limits and timeouts" before raising it.
    max_json_bytes: int = Field(default=8 << 20, ge=1 << 16)
    #: Seconds a client has to send a request's line and headers (from connecting, or from the
    #: first byte of a request on a kept-alive connection).
    header_timeout: float = Field(default=20.0, gt=0, le=3600)
    #: A request body must bring ``min_body_rate`` bytes a second over every window of this many
    #: seconds (while the server is reading it), else the connection is closed.
    body_timeout: float = Field(default=20.0, gt=0, le=3600)
    min_body_rate: int = Field(default=1024, ge=0)
    #: Seconds an idle kept-alive connection stays open between requests.
    keep_alive_timeout: float = Field(default=5.0, gt=0, le=3600)
    #: Connections served at once (per worker); past it new requests get 503.
    max_connections: int = Field(default=512, ge=2, le=1_000_000)
    #: Seconds a client has to take what it was sent, counted from when it last had taken all (or
    #: from the status line); a download waiting for room in ``max_unsent_bytes`` waits on the same
    #: clock. Past it the connection is reset (:mod:`service.api.http.protocol`).
    write_timeout: float = Field(default=30.0, gt=0, le=3600)
    #: Bytes of downloads (shards, range batches, tensors) read from blob storage and not yet taken
    #: by the clients' sockets, per worker; a piece waits for room (:mod:`service.api.http.streaming`).
    max_unsent_bytes: int = Field(default=256 << 20, ge=1 << 20)
    #: Downloads of shards and range batches from a local blob folder are sent by the kernel
    #: (``sendfile``, :mod:`service.api.http.sendfile`), no byte passing through the server's memory.
    #: False: they are read and streamed piece by piece under ``max_unsent_bytes``.
    sendfile: bool = True
    #: Seconds a signed read URL of a shard stays valid, where the blobs are in S3: clients then
    #: read shard bytes from S3 directly (``POST /v1/shards/urls``). 0: every read goes through the server.
    read_url_seconds: int = Field(default=900, ge=0, le=7 * 24 * 3600)
    #: Seconds the signed URLs of a shard upload stay valid, where the blobs are in S3: clients then
    #: send shard bytes to S3 directly and the server verifies them there (``POST
    #: /v1/shards/<id>/uploads``). 0: every upload goes through the server.
    upload_url_seconds: int = Field(default=900, ge=0, le=7 * 24 * 3600)
    #: Deltas of later versions one tensor stored whole by ``gc --compress`` may serve as their
    #: keyframe before a tensor is stored whole again (:mod:`service.reclaim.compression`); 0: no deltas.
    deltas_per_keyframe: int = Field(default=4, ge=0, le=64)
    #: Bytes of disk a store on a SQLite file keeps beside it for ``rm``, retention and ``gc`` to use
    #: on a full disk (64 MiB; :mod:`service.db.reserve`). 0: none.
    reserve_bytes: int = Field(default=64 << 20, ge=0, le=1 << 40)

    @property
    def home_path(self) -> Path:
        """The home folder, user-expanded."""
        return self.home.expanduser().absolute()

    @property
    def embedded_database(self) -> Path | None:
        """The embedded store's SQLite file when no ``database_url`` names a server database, else None."""
        return self.home_path / METADATA_FILE if self.database_url is None else None

    @property
    def resolved_database_url(self) -> str:
        """The database URL to use."""
        return self.database_url or f"sqlite:///{self.home_path / METADATA_FILE}"

    @property
    def resolved_blobs(self) -> str:
        """The blob store URL to use."""
        return self.blobs or (self.home_path / "blobs").as_uri()

    @property
    def staging_dir(self) -> Path:
        """Where incoming shards are written before they are verified."""
        return self.home_path / "staging"


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
