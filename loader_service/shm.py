"""POSIX shared-memory segments the service creates and removes.

Segments are files under /dev/shm opened with ``os.open`` and mapped with ``mmap``, not
``multiprocessing.shared_memory``: on Python < 3.13 every attach registers with a resource tracker
that unlinks the segment when an unrelated process exits (CPython gh-82300).

NOTE [ Shared-memory cleanup ]
    * Names start with ``dataferry-`` and carry the creating service's pid, so whatever a crashed
      service left behind is recognisable.
    * Space is reserved with ``posix_fallocate`` before any of it is used: at creation (an undersized
      /dev/shm fails at start-up with a message saying how much is needed, instead of a SIGBUS when a
      page is first touched), and for a pool that grows, each range before it is handed out (NOTE
      [ A pool as large as what is in flight ] in loader_service/supervisor/slots.py), never below
      the floor (NOTE [ A /dev/shm floor ]). A segment's size beyond what is reserved is a hole:
      address space, no memory, never touched. A range a pool gives back is punched out again
      (``MADV_REMOVE``): its memory returns to /dev/shm and the range is a hole once more.
    * Mode 0600: only the service's user (and the trainers running as it) can map the pool; with
      ``group`` set, 0660 and owned by that group, for trainers running as other users in it.
    * At start, ``remove_stale`` removes what services killed with SIGKILL left behind. A live
      service holds an exclusive flock on each of its segments (and on a lock file in its runtime
      folder) for as long as it runs; the kernel drops it when the service dies, so liveness is
      known even across PID namespaces that share /dev/shm.
    * The service unlinks its segments on every exit path (``LoaderService.shutdown``, see NOTE
      [ Shutdown order ]). Trainers and workers that still map a segment keep their mapping until they
      unmap it; unlinking only removes the name.

NOTE [ A /dev/shm floor ]
    /dev/shm is shared: the trainers' own DataLoader workers, NCCL and other jobs on the host
    allocate there too, and where it is full they fail (ENOSPC, or a SIGBUS when a page is first
    touched). A growing pool must not take it all (a peer that held every slot it was granted once
    grew a pool until a 300 MiB /dev/shm was full, and another job's 16 MiB allocation failed). So
    the pool never grows by a slot that would leave less than ``shm_floor`` of /dev/shm free: a
    tenth of its size, or a quarter where that is less than 64 MiB (at most 64 MiB then), e.g.
    16 MiB of a 64 MiB container's, 64 MiB of 300 MiB, 6.4 GiB of 64 GiB. Such a growth is refused
    before anything is reserved (counted as the feed's ``pool_refused``, logged at most once a
    minute), the trainers share the slots there are, and the pool tries again a second later at the
    soonest: what others free may be its again. The floor bounds growth only: the slots reserved at
    start (all of a fixed ``--slots``) and a sample cache are what the operator asked for, and start
    or fail whole. ``status`` shows the floor beside /dev/shm's free bytes (``shm``).

NOTE [ Hostile /dev/shm ]
    /dev/shm and the temp dir are writable by every user, and the service scans both at start, so
    anyone can put a FIFO, a link, a device or a folder named ``dataferry-<pid>-*`` in its way, or
    swap an entry while it is scanned. Cleanup must not hang on one (a plain ``open`` of a FIFO waits
    for a writer forever), nor follow one out of the directory, nor crash start-up over one:
    * a name is ours only if it matches ``dataferry-<ASCII digits>-<segment-name characters>``;
    * only a regular file or a real folder owned by our effective uid is a candidate, judged by
      ``lstat`` (the scan's cached type may be stale), then opened with ``O_NOFOLLOW | O_NONBLOCK``
      and checked with ``fstat`` to be the very entry ``lstat`` saw;
    * a folder is emptied through directory fds, never by name, so nothing in it is followed or
      opened except folders (``O_DIRECTORY`` refuses anything else without waiting);
    * any ``OSError`` on one entry (it vanished, changed type, is a link now) skips that entry,
      logged at debug level.
    Unlinking a name never opens or follows what it names, and in a sticky directory only its owner
    (us) or root can swap it between our check and the unlink.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from protocol.layout import SEGMENT_PREFIX, validate_segment_name

SHM_DIR = Path("/dev/shm")
LOCK_NAME = "lock"
"""File in a service's runtime folder that it keeps flocked while it runs."""
log = logging.getLogger(__name__)
SLOT_POOL = "the slot pool"
SAMPLE_CACHE = "the decoded-sample cache"
REMEDIES = {
    SLOT_POOL: "Lower --slots, --batch-size or --image-size",
    SAMPLE_CACHE: "Lower --cache-memory",
}
"""What a segment is for, and what the operator can lower when /dev/shm cannot hold it."""


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
    def create(
        cls,
        name: str,
        size: int,
        group: str = "",
        purpose: str = SLOT_POOL,
        reserve: tuple[tuple[int, int], ...] | None = None,
    ) -> Segment:
        """A new segment of ``size`` bytes with the ``(offset, bytes)`` ranges of ``reserve`` (default:
        all of it) reserved now; SharedMemoryError naming ``purpose`` (one of ``REMEDIES``) and what
        to change if /dev/shm cannot hold them."""
        path = SHM_DIR / validate_segment_name(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            restrict(fd, group)
            os.ftruncate(fd, size)
            ranges = ((0, size),) if reserve is None else reserve
            _reserve(fd, ranges, purpose)
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

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Reserve memory for one more range of the creator's segment; False if /dev/shm would then
        keep less than its floor free (NOTE [ A /dev/shm floor ]) or cannot hold it (nothing of
        the range may then be touched)."""
        assert self._lock_fd is not None, "only the creator reserves"
        return nbytes <= shm_room() and _fallocate(self._lock_fd, offset, nbytes)

    def give_back(self, offset: int, nbytes: int) -> None:
        """Return a reserved range's memory to /dev/shm: a hole again, as before ``reserve``. Nobody
        may touch the range until it is reserved again (NOTE [ Giving slots back ] in
        loader_service/supervisor/slots.py)."""
        assert self.owner, "only the creator gives back"
        self.buf.madvise(mmap.MADV_REMOVE, offset, nbytes)

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


def process_start(pid: int) -> str:
    """When process ``pid`` started (``/proc/PID/stat``), "" once it is gone: what a decode worker
    watches the service by, its parent being the template (NOTE [ Workers from a template ] in
    supervisor/workers/pool.py); a recycled pid does not share it. The service takes its own, so a
    worker that boots after the service is gone does not take "" for the service."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(pid: int) -> bool:
    """Is ``pid`` a running loader service? (A recycled pid running something else is not.)"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"loader_service" in cmdline or b"loader-service" in cmdline


@contextlib.contextmanager
def scratch_folder(purpose: str, parent: Path | None = None) -> Iterator[Path]:
    """A temporary folder of this process for the block, named (``scratch_prefix``) and flocked as a
    runtime folder is: one a killed process left is removed at the next start, and a live one never,
    whatever PID namespace it runs in (NOTE [ Shared-memory cleanup ]). Removed on leaving."""
    path = Path(tempfile.mkdtemp(prefix=scratch_prefix(purpose), dir=parent))
    try:
        lock = hold_lock(path / LOCK_NAME)
        try:
            yield path
        finally:
            os.close(lock)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def scratch_prefix(purpose: str) -> str:
    """How a temporary folder of this process begins (``tempfile.mkdtemp(prefix=...)``): named as a
    runtime folder is, with the pid, so that one a killed process left behind (an index scan's
    fetched shards, a list's copy) is removed at the next start like its segments."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{purpose}-"


def hold_lock(path: Path) -> int:
    """Create ``path`` and keep it exclusively flocked for this process's life: its liveness mark."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


_STALE_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"([0-9]+)-[A-Za-z0-9_.-]+")
"""What a segment or runtime folder of ours is called. ``[0-9]`` and not ``str.isdigit()``: that also
accepts other scripts' digits, which ``int()`` reads as a pid (or refuses with ValueError)."""
_NO_WAIT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""How cleanup opens anything: never through a link, and never waiting (a FIFO opens at once)."""


def remove_stale(directories: tuple[Path, ...] = (SHM_DIR,)) -> list[str]:
    """Remove ``dataferry-<pid>-*`` segments and runtime folders whose service is gone.

    A service killed with SIGKILL cannot clean up after itself (NOTE [ Shared-memory cleanup ]);
    its successor does it at start. An entry is left alone while its creator holds its flock (a live
    service, in any PID namespace sharing this /dev/shm), or while its pid runs a loader service.

    The directories are shared with every user of the machine (NOTE [ Hostile /dev/shm ]): only a
    regular file or a real folder, owned by our uid, named exactly as we name them, is ever opened
    or removed; anything else, and any entry that fails a system call, is skipped.
    """
    removed = []
    for directory in directories:
        removed += _remove_stale_in(directory)
    return removed


def _remove_stale_in(directory: Path) -> list[str]:
    removed = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if _remove_if_stale(entry):
                    removed.append(entry.path)
    except OSError as exc:  # missing, unreadable, not a folder: nothing of ours to clean there
        log.debug("stale-segment scan of %s skipped: %s", directory, exc)
    return removed


def _remove_if_stale(entry: os.DirEntry[str]) -> bool:
    pid = _pid_of(entry.name)
    if pid is None:
        return False
    try:
        return _remove_if_dead(entry.path, pid)
    except OSError as exc:  # it vanished, changed type, or is not ours to open: leave it
        log.debug("stale-segment check skipped %r: %s", entry.path, exc)
        return False


def _pid_of(name: str) -> int | None:
    match = _STALE_NAME.fullmatch(name)
    return int(match[1]) if match else None


def _remove_if_dead(path: str, pid: int) -> bool:
    """Remove ``path`` if it is a segment or runtime folder of ours whose service is gone.

    The entry's cached type from the scan may be stale, so it is checked afresh with ``lstat``, and
    once more with ``fstat`` on what ``open`` returned, in case it was swapped in between.
    """
    seen = os.lstat(path)
    folder = stat.S_ISDIR(seen.st_mode)
    if not (folder or stat.S_ISREG(seen.st_mode)) or seen.st_uid != os.geteuid():
        return False
    fd = os.open(path, _NO_WAIT | (os.O_DIRECTORY if folder else 0))
    try:
        if not _same_entry(seen, os.fstat(fd)):
            return False
        if pid == os.getpid() or _lock_held(fd, folder) or _owner_alive(pid):
            return False
        if folder:
            _empty_folder(fd)
            os.rmdir(path)
        else:
            os.unlink(path)  # removes the name only; in a sticky folder only we can have swapped it
    finally:
        os.close(fd)
    return True


def _same_entry(seen: os.stat_result, opened: os.stat_result) -> bool:
    """Is what we opened what ``lstat`` saw? The inode number alone is not enough: a file system
    may give a FIFO created in its place the number the removed file had."""
    same_kind = stat.S_IFMT(seen.st_mode) == stat.S_IFMT(opened.st_mode)
    return os.path.samestat(seen, opened) and same_kind and seen.st_uid == opened.st_uid


def _lock_held(fd: int, folder: bool) -> bool:
    """Does a live process hold the flock on the segment open at ``fd`` (on the lock file, for a
    runtime folder)? The kernel drops it when its holder dies, however it dies and whatever PID
    namespace it runs in."""
    if not folder:
        return _flock_held(fd)
    try:
        lock = os.open(LOCK_NAME, _NO_WAIT, dir_fd=fd)
    except FileNotFoundError:
        return False  # killed between creating its folder and locking it
    try:
        # A lock that is not a regular file is none a service made: spare the folder.
        return not stat.S_ISREG(os.fstat(lock).st_mode) or _flock_held(lock)
    finally:
        os.close(lock)


def _flock_held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False  # closing the fd drops the flock we just took


def _empty_folder(fd: int) -> None:
    """Remove what the folder open at ``fd`` holds, without following links or opening anything
    but folders (``shutil.rmtree`` opens folders by name, without ``O_NONBLOCK``)."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.name, dir_fd=fd)
                continue
            inner = os.open(entry.name, _NO_WAIT | os.O_DIRECTORY, dir_fd=fd)
            try:
                _empty_folder(inner)
            finally:
                os.close(inner)
            os.rmdir(entry.name, dir_fd=fd)


def _fallocate(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve the range; False where /dev/shm cannot hold it (any other error is raised)."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        return False
    return True


def _reserve(fd: int, ranges: tuple[tuple[int, int], ...], purpose: str) -> None:
    """Reserve every range, or none: ranges that together pass what /dev/shm has free are refused
    before any is reserved, since reserving them one by one (a slot each, NOTE [ Encoded rows ])
    would first take all of /dev/shm, which is memory, and the host's processes with it."""
    size = sum(nbytes for _, nbytes in ranges)
    if size > _free_bytes(SHM_DIR) or not all(_fallocate(fd, offset, nbytes) for offset, nbytes in ranges):
        free = _free_bytes(SHM_DIR)
        raise SharedMemoryError(
            f"/dev/shm has {free / 2**20:.0f} MiB free but {purpose} needs {size / 2**20:.0f} MiB. "
            f"{REMEDIES[purpose]}, or enlarge /dev/shm "
            "(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory; "
            "host: mount -o remount,size=NG /dev/shm)."
        ) from None


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


FLOOR_SHARE = 10
"""/dev/shm kept free for others: one part in this many of its size (NOTE [ A /dev/shm floor ])..."""
FLOOR_SMALL = 64 * 2**20
"""... or, where a tenth is less, a quarter of it up to this many bytes."""


def shm_floor(size: int) -> int:
    """The bytes of a /dev/shm of ``size`` bytes a pool's growth leaves free (NOTE [ A /dev/shm
    floor ])."""
    return max(size // FLOOR_SHARE, min(FLOOR_SMALL, size // 4))


def shm_room(directory: Path = SHM_DIR) -> int:
    """Bytes a pool may still reserve in ``directory`` and leave its floor free; 0 where it cannot
    be read. One ``statvfs``."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return max(0, st.f_bavail * st.f_frsize - shm_floor(st.f_blocks * st.f_frsize))
