"""The one exception tree shared by the service and the client.

    CheckpointError                      code              HTTP
    ├── InvalidInputError (ValueError)   invalid_input     400
    │   ├── InvalidNameError             invalid_name      400
    │   ├── InvalidShardError            invalid_shard     400
    │   ├── InvalidManifestError         invalid_manifest  422
    │   ├── StateEncodingError (TypeError) state_encoding  400
    │   ├── RangeNotSatisfiableError     range_not_satisfiable 416
    │   ├── UnsupportedMediaTypeError    unsupported_media_type 415
    │   └── RequestTimeoutError          request_timeout   408
    ├── NotFoundError (LookupError)      not_found         404
    ├── ConflictError                    conflict          409
    │   ├── MissingTensorsError          missing_tensors   409
    │   └── DirectUploadsUnavailableError direct_uploads_unavailable 409
    ├── IntegrityError                   integrity         400 on upload, 500 on read
    ├── StateMismatchError               state_mismatch    (client side only)
    ├── PayloadTooLargeError             payload_too_large 413
    ├── ServerBusyError                  unavailable       503 (with Retry-After)
    ├── AuthenticationError              unauthorized      401
    │   └── PermissionDeniedError        forbidden         403
    └── StorageError (OSError)           storage           503
        └── StorageFullError             storage_full      507

Every class carries a stable ``code`` string. The HTTP face sends it as the
``X-Error-Code`` header and the client maps it back with :func:`error_class_for_code`,
so an error raised in the engine reaches user code as the same class in embedded and
HTTP mode.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import ClassVar

from ckptstore.service.secrets_mask import mask_urls


class CheckpointError(Exception):
    """Root of every error ckptstore raises on purpose."""

    code: ClassVar[str] = "checkpoint_error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInputError(CheckpointError, ValueError):
    """Something a caller sent is malformed; the message names the field and the fix."""

    code = "invalid_input"
    http_status = 400


class InvalidNameError(InvalidInputError):
    """A run id, tag or version reference does not match its strict pattern."""

    code = "invalid_name"


class InvalidShardError(InvalidInputError):
    """A shard is not a well-formed ckptstore safetensors file."""

    code = "invalid_shard"


class InvalidManifestError(InvalidInputError):
    """A manifest or commit request breaks the format's rules."""

    code = "invalid_manifest"
    http_status = 422


class StateEncodingError(InvalidInputError, TypeError):
    """A value in optimizer, scheduler or extra state cannot be stored as JSON or tensor."""

    code = "state_encoding"


class RangeNotSatisfiableError(InvalidInputError):
    """A requested byte range starts past the end of a blob of ``size`` bytes (None when unknown)."""

    code = "range_not_satisfiable"
    http_status = 416

    def __init__(self, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.size = size


class UnsupportedMediaTypeError(InvalidInputError):
    """A request body is not sent as the media type its route reads (JSON: ``application/json``)."""

    code = "unsupported_media_type"
    http_status = 415


class RequestTimeoutError(InvalidInputError):
    """A request's body came too slowly: below the server's least rate over a whole window."""

    code = "request_timeout"
    http_status = 408


class NotFoundError(CheckpointError, LookupError):
    """A run, version, tag, tensor or blob does not exist."""

    code = "not_found"
    http_status = 404


class ConflictError(CheckpointError):
    """The request clashes with the store's current state."""

    code = "conflict"
    http_status = 409


class DirectUploadsUnavailableError(ConflictError):
    """The server takes no uploads straight to its blob store (its blobs are not in S3, or direct
    uploads are turned off): send the shard through the server instead."""

    code = "direct_uploads_unavailable"


class MissingTensorsError(ConflictError):
    """A commit references tensors the store does not hold; ``digests`` lists them."""

    code = "missing_tensors"

    def __init__(self, message: str, digests: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.digests = list(digests)


class IntegrityError(CheckpointError):
    """Bytes do not match the digest they were stored or announced under."""

    code = "integrity"
    http_status = 400


class StateMismatchError(CheckpointError):
    """A checkpoint does not fit the model or optimizer it is loaded into.

    ``missing_keys`` are expected by the target but absent from the checkpoint;
    ``unexpected_keys`` are in the checkpoint but unknown to the target.
    """

    code = "state_mismatch"
    http_status = 409

    def __init__(
        self,
        message: str,
        missing_keys: Sequence[str] = (),
        unexpected_keys: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)


class PayloadTooLargeError(CheckpointError):
    """A request body, header or name is larger than the server accepts."""

    code = "payload_too_large"
    http_status = 413


class ServerBusyError(CheckpointError):
    """The server is at one of its limits (connections, memory for answers); retry shortly."""

    code = "unavailable"
    http_status = 503


class AuthenticationError(CheckpointError):
    """No valid bearer token was presented."""

    code = "unauthorized"
    http_status = 401


class PermissionDeniedError(AuthenticationError):
    """The token is valid but its scope does not allow the operation."""

    code = "forbidden"
    http_status = 403


class StorageError(CheckpointError, OSError):
    """The metadata database or blob store failed; the operation left no partial state.

    The message often quotes a driver's or S3 client's own text, which may hold a URL with its
    credentials (botocore names the endpoint it could not reach): every URL in it is shown with
    its secrets masked (:func:`service.secrets_mask.mask_urls`).
    """

    code = "storage"
    http_status = 503

    def __init__(self, message: str) -> None:
        super().__init__(mask_urls(message))


class StorageFullError(StorageError):
    """The disk holding the store's files (or the database's) is full, or its quota is spent.

    Not a passing outage: retrying changes nothing until space is freed, so a server answers
    507 and the client raises at once. The message names the folder that is full and what to
    run (:meth:`of_folder`).
    """

    code = "storage_full"
    http_status = 507

    @classmethod
    def of_folder(cls, folder: object, cause: object, *, fix: str | None = None) -> StorageFullError:
        """The error for a full disk under ``folder``, quoting ``cause`` (the system's words) and
        the way out (``fix``, else :data:`FREE_SPACE`)."""
        return cls(f"the disk holding {folder} is full ({cause}); nothing was stored: {fix or FREE_SPACE}")


#: What to run on a full disk: deleting versions needs no room the store has not kept for it.
FREE_SPACE = (
    "free space with `ckptstore rm RUN@VERSION` for versions you can spare, then `ckptstore gc --grace 0` "
    "(saves in progress keep what they hold); both may use the space the store keeps in reserve for them"
)
#: ``errno`` values of a disk with no room left: no space, or the user's quota spent.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: SQLite's primary result code for "database or disk is full", and its extended code for a
#: shared-memory file (``-shm``) it could not grow, which only a full disk causes.
_SQLITE_FULL = 13
_SQLITE_IOERR_SHMSIZE = 4874
#: PostgreSQL's SQLSTATE ``disk_full``.
_POSTGRES_DISK_FULL = "53100"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it wraps (``orig`` of a SQLAlchemy error, or its cause), says
    the disk is full: ENOSPC or EDQUOT, SQLite's SQLITE_FULL, PostgreSQL's ``disk_full``."""
    for _depth in range(6):
        if exc is None:
            return False
        if isinstance(exc, StorageFullError):
            return True
        if isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS:
            return True
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int) and (code & 0xFF == _SQLITE_FULL or code == _SQLITE_IOERR_SHMSIZE):
            return True
        if getattr(exc, "sqlstate", None) == _POSTGRES_DISK_FULL:
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__
    return False


def _all_subclasses(cls: type[CheckpointError]) -> list[type[CheckpointError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


def error_class_for_code(code: str) -> type[CheckpointError]:
    """Return the exception class registered for ``code`` (the root class if unknown)."""
    for cls in _all_subclasses(CheckpointError):
        if cls.code == code:
            return cls
    return CheckpointError


def format_list(items: Sequence[str], limit: int = 10) -> str:
    """Render up to ``limit`` items for an error message, saying how many were left out."""
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f" … and {len(items) - limit} more"
    return shown
