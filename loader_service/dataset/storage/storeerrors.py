"""What a store's (or the local disk's) failure is: the start refused (StorageError), a bad sample
(DecodeError), the task done later (StoreUnavailable), or a full disk (LocalDiskFull)."""

from __future__ import annotations

import errno
import re

from loader_service.dataset.tables import DatasetError
from protocol.pixels import DecodeError


class StorageError(DatasetError):
    """The data cannot be reached at start (no access, no such bucket): the service exits 2."""


class LocalDiskFull(DatasetError):
    """A fetched object could not be written: the local disk, or the user's quota on it, is full."""


FULL_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))


def local_write_error(exc: OSError, what: str) -> DatasetError:
    """What a failed write to local disk is: LocalDiskFull where the disk (or a quota) is full, for
    the caller to do without what it was writing; else a DatasetError. ``what`` names the write."""
    kind = LocalDiskFull if exc.errno in FULL_ERRNOS else DatasetError
    return kind(f"{what}: {exc.strerror or exc}")


class StoreUnavailable(Exception):
    """The store did not answer within the read deadline: the task is done again later, nothing lost."""


_DENIED = ("403 Forbidden", "401 Unauthorized", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")


def denied(exc: Exception) -> bool:
    """A refusal obstore reports as a generic error (a listing's 403 is one)."""
    return any(word in str(exc) for word in _DENIED)


def not_found(exc: Exception) -> bool:
    # obstore raises the builtin FileNotFoundError for a 404 (its NotFoundError class exists too).
    return isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError"


def first_line(exc: BaseException) -> str:
    """An obstore error's first line: the rest is a debug dump that may quote request headers."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


_STATUS = re.compile(r"\b([1-5][0-9]{2}) [A-Z][A-Za-z ]+")

_TRANSIENT_STATUS = {408, 429}
"""4xx answers that say "later", not "never": a timeout and too many requests."""


def sample_error(exc: Exception, url: str) -> Exception:
    """What a failed read of ``url`` in a worker is: a bad sample (DecodeError: the object, or this
    request for it, is wrong and asking again cannot help) or StoreUnavailable (the store is down,
    slow or overloaded: obstore already retried within the deadline; the task is done later)."""
    kind = type(exc).__name__
    if not_found(exc):
        return DecodeError(f"{url}: not found (deleted since it was indexed?)")
    if kind == "PreconditionError":
        return DecodeError(f"{url}: changed since it was indexed (its ETag differs)")
    if kind in ("InvalidPathError", "PermissionDeniedError") or isinstance(exc, ValueError):
        return DecodeError(f"{url}: {first_line(exc)}")
    status = _STATUS.search(str(exc))
    code = int(status.group(1)) if status else 0
    if 400 <= code < 500 and code not in _TRANSIENT_STATUS:
        return DecodeError(f"{url}: the store answered {status.group(0) if status else code}")
    return StoreUnavailable(f"{url}: {first_line(exc)}")
