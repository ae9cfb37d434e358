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

Every class carries a stable ``code`` string. The HTTP face sends it as the
``X-Error-Code`` header and the client maps it back with :func:`error_class_for_code`,
so an error raised in the engine reaches user code as the same class in embedded and
HTTP mode.
"""

from __future__ import annotations

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
