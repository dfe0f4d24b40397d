"""The cache folder (``--cache-dir``, ``--cache-size``): objects fetched from a store, and saved indexes,
kept across restarts and shared by the service and its workers.

NOTE [ Fetch cache ]
    ``objects/AB/HASH`` is one whole object, HASH that of its URL, ETag and size: an object replaced
    in the store has another name, so it is fetched again and never read stale. An entry is written
    under ``tmp/PID/`` and renamed into place, so a reader sees all of it or nothing, whoever wrote
    it. The folder never holds more than ``--cache-size`` bytes: a writer reserves the entry's size
    in ``usage`` (a counter changed under an flock on ``lock``) before it writes, and an entry that
    does not fit is not kept. Nothing is evicted: under a new permutation every epoch no entry is
    likelier to be read next than another, so the first ones in stay (as in NOTE [ Sample cache ]).
    A folder is one service's at a time (``claim``, an flock held while it runs): every start
    recounts ``usage`` from the files and removes what killed writers left in ``tmp/``. Saved
    indexes (``indexes/KEY/``) count against the size too; the shards being indexed (up to four,
    ``objectfolder.FETCH_AHEAD``) sit in ``tmp/`` meanwhile, and are counted once kept.

NOTE [ A private cache folder ]
    What the folder holds is trusted at the next start: a saved index names the files to read and
    their labels, an entry is served as the object. So only the service's user may write there: the
    folder is made 0700 whatever the umask (a unit's ``UMask=0007`` gave its group write access,
    and a trainer in the group could rewrite a saved index). A folder another user owns is refused
    (exit 2); one others could write in is emptied before it is used, then made 0700; one others
    could only read is made 0700.

NOTE [ Saved indexes ]
    Indexing a million tar samples reads two million headers (seconds, or minutes from a cold disk
    or a store). The index of a ``--data`` value is saved under a key of its format and value, with
    what its source says identifies the data's state (``Format.inputs``: each shard's size and
    mtime, or each object's ETag). At the next start the inputs are taken again, a cheap listing, and
    an equal record loads the saved index instead of scanning; any difference scans anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loader_service.dataset.storage.storeconfig import StorageConfig
from loader_service.dataset.storage.storeerrors import FULL_ERRNOS, LocalDiskFull, local_write_error
from loader_service.dataset.tables import DatasetError

log = logging.getLogger(__name__)

LOCK_TIMEOUT = 10.0
"""Seconds to wait for the usage lock before giving up on keeping an entry."""
_USAGE = struct.Struct("<q")


class FetchCache:
    """The cache folder of NOTE [ Fetch cache ] and NOTE [ Saved indexes ]."""

    def __init__(self, directory: str | Path, size: int) -> None:
        self.dir = Path(directory)
        self.size = size
        self.objects = self.dir / "objects"
        self.indexes = self.dir / "indexes"
        self.tmp = self.dir / "tmp" / str(os.getpid())
        """This process's own temporary folder, made by its first writer (workers only read)."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._keep_private()
            for folder in (self.objects, self.indexes):
                folder.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise local_write_error(exc, f"cache folder {self.dir}") from None

    def _keep_private(self) -> None:
        """NOTE [ A private cache folder ]: the folder is the service's user's, mode 0700. One that
        another user owns is refused; one that others could write in has its contents removed,
        since any of them may have been written by whoever could, and is made 0700."""
        st = self.dir.stat()
        if st.st_uid != os.geteuid():
            raise DatasetError(
                f"cache folder {self.dir} belongs to uid {st.st_uid}, not to this service's user "
                f"(uid {os.geteuid()}): give the service a folder of its own"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            log.warning(
                "cache folder %s was writable by others (mode %o): what it held is not trusted and is "
                "removed; it is now 0700",
                self.dir,
                mode,
            )
            for name in ("objects", "indexes", "tmp", "usage"):
                _remove(self.dir / name)
        if mode & 0o077:
            os.chmod(self.dir, 0o700)

    @classmethod
    def of(cls, storage: StorageConfig) -> FetchCache | None:
        """The cache folder ``storage`` names, if it names one."""
        return cls(storage.cache_dir, storage.cache_size) if storage.cache_dir else None

    # --- objects ----------------------------------------------------------------------------------

    def entry(self, url: str, etag: str, size: int) -> Path:
        digest = hashlib.sha256(f"{url}\0{etag}\0{size}".encode("utf-8", "surrogateescape")).hexdigest()
        return self.objects / digest[:2] / digest

    def holds(self, url: str, etag: str, size: int) -> Path | None:
        """The entry of this object, if it is kept (an object without an ETag never is)."""
        if not etag:
            return None
        path = self.entry(url, etag, size)
        return path if path.is_file() else None

    def scratch(self) -> Path:
        """This process's temporary folder, on the cache's file system: what is written there can be
        renamed into place."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self.tmp

    def temp_file(self) -> Path:
        """A fresh name under this process's temporary folder."""
        return self.scratch() / f"{time.monotonic_ns()}-{os.urandom(4).hex()}"

    def adopt(self, written: Path, url: str, etag: str, size: int) -> bool:
        """Keep the file ``written`` (``size`` bytes of the object) as its entry, if there is room;
        False (and ``written`` left for the caller) if not."""
        if not etag or not self.reserve(size):
            return False
        path = self.entry(url, etag, size)
        try:
            path.parent.mkdir(exist_ok=True)
            if path.exists():  # another process kept it meanwhile
                self.reserve(-size)
                return False
            os.rename(written, path)
        except OSError:
            self.reserve(-size)
            return False
        return True

    # --- the size ---------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        """Add ``nbytes`` to the usage if the total stays within the size (a negative amount frees)."""
        with self._locked() as fd:
            if fd is None:
                return False
            used = _read_usage(fd)
            if nbytes > 0 and used + nbytes > self.size:
                return False
            _write_usage(fd, max(0, used + nbytes))
            return True

    def used(self) -> int:
        with self._locked() as fd:
            return 0 if fd is None else _read_usage(fd)

    def claim(self) -> int:
        """The folder for this service alone, while the returned descriptor stays open: a second
        service would recount the usage under the first one's reservations, and remove its files
        being written. DatasetError if another service holds it."""
        fd = os.open(self.dir / "owner", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DatasetError(f"cache folder {self.dir} is in use by another running service") from None
        return fd

    def recount(self) -> int:
        """Set the usage from the files there are, and remove the temporary files of writers gone
        (at start, with the folder ``claim``ed: no other process writes there then)."""
        self._remove_dead_writers()
        total = sum(_tree_bytes(folder) for folder in (self.objects, self.indexes))
        with self._locked() as fd:
            if fd is not None:
                _write_usage(fd, total)
        return total

    def _remove_dead_writers(self) -> None:
        if not self.tmp.parent.is_dir():
            return
        with os.scandir(self.tmp.parent) as it:
            for entry in it:
                if entry.name != self.tmp.name:  # a pid in another container may be alive: the claim says
                    shutil.rmtree(entry.path, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int | None]:
        fd = os.open(self.dir / "usage", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("cache folder %s: its lock is held too long; not keeping", self.dir)
                        yield None
                        return
                    time.sleep(0.005)
            yield fd
        finally:
            os.close(fd)  # closing drops the lock

    # --- saved indexes (NOTE [ Saved indexes ]) ---------------------------------------------------

    def saved_index(self, key: str, inputs: Any) -> Path | None:
        """The folder of the index saved under ``key`` from these very ``inputs``, if there is one."""
        folder = self.indexes / key
        try:
            saved = json.loads((folder / "inputs.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return folder if saved == _jsonable(inputs) else None

    def save_index(self, key: str, inputs: Any, save: Any) -> bool:
        """Save an index under ``key`` (``save(folder)`` writes it) with the inputs it was built from;
        False if it does not fit."""
        staging: Path | None = None
        reserved = 0
        try:
            staging = self.temp_file()
            staging.mkdir()
            save(staging)
            (staging / "inputs.json").write_text(json.dumps(_jsonable(inputs)), encoding="utf-8")
            folder = self.indexes / key
            old = _tree_bytes(folder) if folder.exists() else 0
            reserved = _tree_bytes(staging) - old
            if not self.reserve(reserved):
                return False
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(staging, folder)
            return True
        except OSError as exc:  # a full disk, say: the index is built, only not kept
            log.warning("cache folder %s: cannot save an index: %s", self.dir, exc.strerror or exc)
            if reserved:
                self.reserve(-reserved)
            return False
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)


def index_key(kind: str, data: str, extra: Any = None) -> str:
    """The name an index is saved under: its format, its ``--data`` value, and options that change it."""
    text = json.dumps([kind, data, extra], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _jsonable(inputs: Any) -> Any:
    return json.loads(json.dumps(inputs))


def _read_usage(fd: int) -> int:
    raw = os.pread(fd, _USAGE.size, 0)
    return int(_USAGE.unpack(raw)[0]) if len(raw) == _USAGE.size else 0


def _write_usage(fd: int, used: int) -> None:
    os.pwrite(fd, _USAGE.pack(used), 0)


def _remove(path: Path) -> None:
    """Remove a file, link or folder tree; links are removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _tree_bytes(folder: Path) -> int:
    total = 0
    for base, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(base, name)).st_size
    return total


def open_cache_folder(folder: str, size: int) -> int | None:
    """A service's start with ``--cache-dir``: the folder claimed as this service's alone, what killed
    writers left removed (NOTE [ Fetch cache ]); the claim's lock, held while the service runs. None
    where its disk is full: the cache only saves work, so the service runs without it."""
    lock = None
    try:
        cache = FetchCache(folder, size)
        lock = cache.claim()
        used = cache.recount()
    except (LocalDiskFull, OSError) as exc:
        if lock is not None:
            os.close(lock)
        if isinstance(exc, OSError) and exc.errno not in FULL_ERRNOS:
            raise
        log.warning("cache folder %s: its disk is full (%s); serving without it", folder, exc)
        return None
    log.info("cache folder %s: %.1f of %.1f GiB used", folder, used / 2**30, size / 2**30)
    return lock
