"""POSIX shared-memory segments the service creates and removes.

Segments are files under /dev/shm opened with ``os.open`` and mapped with ``mmap``, not
``multiprocessing.shared_memory``: on Python < 3.13 every attach registers with a resource tracker
that unlinks the segment when an unrelated process exits (CPython gh-82300).

NOTE [ Shared-memory cleanup ]
    * Names start with ``dataferry-`` and carry the creating service's pid, so whatever a crashed
      service left behind is recognisable.
    * Space is reserved with ``posix_fallocate`` at creation: an undersized /dev/shm fails at start-up
      with a message saying how much is needed, instead of a SIGBUS when a page is first touched.
    * Mode 0600: only the service's user (and the trainers running as it) can map the pool; with
      ``group`` set, 0660 and owned by that group, for trainers running as other users in it.
    * At start, ``remove_stale`` removes what services killed with SIGKILL left behind. A live
      service holds an exclusive flock on each of its segments (and on a lock file in its runtime
      folder) for as long as it runs; the kernel drops it when the service dies, so liveness is
      known even across PID namespaces that share /dev/shm.
    * The service unlinks its segments on every exit path (``LoaderService.shutdown``, see NOTE
      [ Shutdown order ]). Trainers and workers that still map a segment keep their mapping until they
      unmap it; unlinking only removes the name.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import secrets
import shutil
from pathlib import Path

from protocol.layout import SEGMENT_PREFIX, validate_segment_name

SHM_DIR = Path("/dev/shm")
LOCK_NAME = "lock"
"""File in a service's runtime folder that it keeps flocked while it runs."""
log = logging.getLogger(__name__)


class SharedMemoryError(RuntimeError):
    """Shared memory could not be set up; the message says what to change."""


def new_segment_name(feed: str) -> str:
    safe_feed = "".join(ch if ch.isalnum() else "_" for ch in feed)[:40]
    return validate_segment_name(f"{SEGMENT_PREFIX}{os.getpid()}-{safe_feed}-{secrets.token_hex(4)}")


class Segment:
    """One mapped segment. The creator owns the name and must ``unlink``; attachers only ``close``."""

    def __init__(
        self, name: str, size: int, mapping: mmap.mmap, owner: bool, lock_fd: int | None = None
    ) -> None:
        self.name = name
        self.size = size
        self.buf = mapping
        self.owner = owner
        self._lock_fd = lock_fd
        """The creator keeps the segment open with an exclusive flock: the proof it is alive."""

    @classmethod
    def create(cls, name: str, size: int, group: str = "") -> Segment:
        path = SHM_DIR / validate_segment_name(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            restrict(fd, group)
            _reserve(fd, path, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        return cls(name, size, mapping, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        fd = os.open(SHM_DIR / validate_segment_name(name), os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise SharedMemoryError(f"segment {name} holds {actual} bytes, expected {size}")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:
            # A numpy view still exports the buffer; the mapping goes when the last view does.
            pass

    def unlink(self) -> None:
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def restrict(target: int | str, group: str) -> None:
    """Mode 0600, or 0660 owned by ``group`` so trainers running as other users of it can attach."""
    if not group:
        os.chmod(target, 0o600)
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise SharedMemoryError(f"group {group!r} does not exist") from None
    os.chown(target, -1, gid)
    os.chmod(target, 0o660)


def _owner_alive(pid: int) -> bool:
    """Is ``pid`` a running loader service? (A recycled pid running something else is not.)"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"loader_service" in cmdline or b"loader-service" in cmdline


def hold_lock(path: Path) -> int:
    """Create ``path`` and keep it exclusively flocked for this process's life: its liveness mark."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _locked(path: str) -> bool:
    """Does a live process hold the flock on ``path``? The kernel drops it when its holder dies,
    however it dies and whatever PID namespace it runs in."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _in_use(entry: os.DirEntry[str], pid: int) -> bool:
    lock = os.path.join(entry.path, LOCK_NAME) if entry.is_dir(follow_symlinks=False) else entry.path
    return pid == os.getpid() or _locked(lock) or _owner_alive(pid)


def remove_stale(directories: tuple[Path, ...] = (SHM_DIR,)) -> list[str]:
    """Remove ``dataferry-<pid>-*`` segments and runtime folders whose service is gone.

    A service killed with SIGKILL cannot clean up after itself (NOTE [ Shared-memory cleanup ]);
    its successor does it at start. An entry is left alone while its creator holds its flock (a live
    service, in any PID namespace sharing this /dev/shm), or while its pid runs a loader service.
    """
    removed = []
    for directory in directories:
        for entry in os.scandir(directory):
            pid = _pid_of(entry.name)
            if pid is None or _in_use(entry, pid):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except PermissionError:  # another user's leftovers in the sticky /dev/shm or /tmp
                log.warning("cannot remove %s left by pid %d: permission denied", entry.path, pid)
                continue
            removed.append(entry.path)
    return removed


def _pid_of(name: str) -> int | None:
    if not name.startswith(SEGMENT_PREFIX):
        return None
    head = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _reserve(fd: int, path: Path, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        free = _free_bytes(SHM_DIR)
        raise SharedMemoryError(
            f"/dev/shm has {free / 2**20:.0f} MiB free but the slot pool needs {size / 2**20:.0f} MiB. "
            "Lower --slots, --batch-size or --image-size, or enlarge /dev/shm "
            "(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory; "
            "host: mount -o remount,size=NG /dev/shm)."
        ) from None


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
