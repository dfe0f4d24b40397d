"""A private service for one trainer process: what ``ServiceLoader.local`` starts and stops.

The service runs as ``loader-service serve`` (a separate process: the trainer side never imports the
service side) with ``--stop-with-stdin`` and a pipe on its stdin whose write end only this process
holds, so it stops when the loader closes and also when this process dies by any means (NOTE [ Stop
with stdin ] in loader_service/supervisor/edges/lifeline.py). Its log goes to this process's
standard error. With ``DATAFERRY_ENDPOINTS`` set none is started, and the shared feed attached to
instead must be what the call asked for (NOTE [ A shared service for a local call ]).

NOTE [ A private service ]
    Another local user must not be able to stand in for a trainer's private service (a review
    did: it watched ``/proc`` for the command line, bound the socket path named there in the
    shared temp folder 0.5 ms later, and answered READY on the abstract socket the trainer
    listened on; the trainer trained an epoch on its batches). So:
    * the socket is ``service.sock`` in a folder made 0700 by this process before the child
      starts (``tempfile.mkdtemp``): only this user can bind or replace anything in it;
    * readiness arrives on one end of a socket pair whose other end the child inherits
      (``$DATAFERRY_NOTIFY_FD``), not on a name anyone could write to;
    * once READY, the process listening on the socket must be the child itself (its pid, by
      ``SO_PEERCRED``); every attach then checks the listener and the pool's owner as for any
      service (NOTE [ A service's identity ] in gpu_worker/peer.py);
    * after READY the child is watched: the loader's every wait asks whether it has exited, and
      a dead child fails the loop at once with its exit code, not after the loader's ``timeout``;
    * the child imports nothing from this process's working folder, which another user may write
      in (a trainer run from /tmp): ``python -m`` would put that folder first on its path, and a
      ``loader_service`` package planted there would run as this user (a review's re-ran the real
      service on other data: the trainer trained on white images). It runs ``SERVICE_BOOT`` with
      ``-c`` instead, which drops the folder ``-c`` puts first, and with ``-P`` (Python 3.11+),
      which multiprocessing passes on to the children it starts; on every version the service
      starts those (the workers' template, the resource tracker) from its private folder, and its
      pipeline probe as this one (NOTE [ Nothing from the working folder ] in
      loader_service/working_folder.py). Its path is otherwise the trainer's interpreter's:
      ``PYTHONPATH``, the user's site-packages and editable installs as before (no ``-I``, which
      would drop them); a checkout used without being installed needs ``pip install -e .`` or
      ``PYTHONPATH``. A pipeline named ``package.module:FUNC`` is still looked for in the working
      folder, as ``python -m`` would (the user named it); ``FILE.py:FUNC`` keeps the folder out.
    The folder goes when the loader closes. It is named and flocked as a service's runtime folder
    is (``dataferry-<pid>-local-*``, a held ``lock`` file), so one that a trainer killed with
    SIGKILL leaves behind is removed by the next service that starts on the host.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from gpu_worker.connection import ServiceError
from gpu_worker.loader_config import ENDPOINTS_ENV, endpoints_from_env
from gpu_worker.peer import listener_of
from protocol.messages import FeedInfo

log = logging.getLogger(__name__)

START_TIMEOUT = 600.0
"""Seconds a private service may take to be ready: it indexes the data before it listens."""
STOP_TIMEOUT = 30.0
"""Seconds it may take to stop once its stdin has closed, before SIGTERM, then SIGKILL."""
POLL = 0.2
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()
"""Put no unsafe folder on the path; inherited by the children multiprocessing starts (NOTE [ A
private service ])."""
SERVICE_BOOT = (
    "import sys\n"
    "if not getattr(sys.flags, 'safe_path', False):\n"
    "    del sys.path[0]  # the working folder, which -c puts first\n"
    "import runpy\n"
    "runpy.run_module('loader_service', run_name='__main__', alter_sys=True)\n"
)
"""``python -m loader_service``, minus the working folder (NOTE [ A private service ])."""
NOTIFY_FD_ENV = "DATAFERRY_NOTIFY_FD"
"""The descriptor the child notifies on (``loader_service.supervisor.edges.systemd`` reads it)."""
CHILD_UNSET = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""A trainer under systemd must not have its private service speak to systemd for it."""


def serve_flags(options: Mapping[str, object]) -> list[str]:
    """``serve`` flags for keyword options: ``batch_size=64`` is ``--batch-size 64``, ``strict=True``
    ``--strict``, ``strict=False`` ``--no-strict``; None leaves the option at its default."""
    flags: list[str] = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, str | int | float | os.PathLike):
            flags += [f"--{flag}", os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
        else:
            raise TypeError(f"serve option {name}: {type(value).__name__} is not a flag value")
    return flags


def expected_option(serve_options: Mapping[str, object], key: str) -> int | None:
    """A batch-shaping ``local`` option as the loader's expectation; None where it was not given."""
    value = serve_options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"serve option {key}: a whole number, not {value!r}")
    return value


CHECKED_OPTIONS = ("seed", "augment", "interpolation", "pipeline")
"""``local`` options a shared service must serve as given, beside ``data`` (NOTE [ A shared service
for a local call ]); the geometry (``batch_size``, ``image_size``) is its hello's, which the service
itself checks."""


def served_differently(
    info: FeedInfo, data: str | os.PathLike[str], options: Mapping[str, object]
) -> list[str]:
    """What a ``local`` call asks that the shared feed ``info`` does not serve, one ``NAME ASKED
    (it serves SERVED)`` each.

    NOTE [ A shared service for a local call ]
        With ``DATAFERRY_ENDPOINTS`` set, ``ServiceLoader.local(data, **options)`` attaches to the
        shared service instead of starting one, and must not train on something else than it asked
        for (a review's attached to a service of the same geometry on another dataset, another
        seed, another transform, and trained on it without a word). The feed's welcome says where
        its data is (``FeedInfo.data``: a path made absolute on its host, or a store's URL) and its
        seed, transform, resize filter and pipeline; ``data`` is compared always, made absolute as
        the service makes it (the same data under another path is refused: name it as the service
        does), and each of ``CHECKED_OPTIONS`` when the call gives it: an option left out is the
        shared service's business, and so are the others (workers, caches, limits). Several
        services of a fleet agree on the rest (NOTE [ A fleet ]); the first one's is compared.
    """
    given = {key: options[key] for key in CHECKED_OPTIONS if options.get(key) is not None}
    pipeline = given.pop("pipeline", None)
    asked: dict[str, object] = {"data": _where(os.fspath(data)), **given}
    words = dict(word.partition("=")[::2] for word in info.decoding.split())
    served: dict[str, object] = {
        "data": _where(info.data) if info.data else f"sources {', '.join(info.sources)}",
        "seed": info.seed,
        "augment": info.augment,
        "interpolation": words.get("interpolation", "none: a pipeline's feed"),
        "pipeline": info.pipeline or "none: the built-in transforms",
    }
    if pipeline is not None:  # a pipeline's feed has no built-in transform or filter to compare
        asked = {"data": asked["data"], "seed": asked.get("seed"), "pipeline": _pipeline(str(pipeline))}
    return [
        f"{key} {value!r} (it serves {served[key]!r})"
        for key, value in asked.items()
        if value is not None and str(value) != str(served[key])
    ]


def _where(data: str) -> str:
    """``data`` as a service names it: a store's URL as given, a path made absolute on this host."""
    if "://" in data:
        return data.rstrip("/")
    return str(Path(data).expanduser().resolve())


def _pipeline(spec: str) -> str:
    """A ``FILE.py:FUNC`` pipeline with its file made absolute, as the service makes it."""
    module, _, func = spec.rpartition(":")
    return f"{Path(module).expanduser().resolve()}:{func}" if module.endswith(".py") else spec


def unless_shared(
    data: str | os.PathLike[str], options: Mapping[str, object], start_timeout: float
) -> LocalService | None:
    """A private service for ``local``, or None where ``DATAFERRY_ENDPOINTS`` names shared ones."""
    if shared := endpoints_from_env():
        log.info("%s is set: attaching to %s, no private service", ENDPOINTS_ENV, ", ".join(shared))
        return None
    return LocalService(data, options, start_timeout)


def check_shared(info: FeedInfo, data: str | os.PathLike[str], options: Mapping[str, object]) -> None:
    """ServiceError naming each way the shared feed ``info`` is not what a ``local`` call asked
    (NOTE [ A shared service for a local call ])."""
    differences = served_differently(info, data, options)
    if differences:
        raise ServiceError(
            f"{ENDPOINTS_ENV} names a service whose feed {info.name!r} is not what this call asked for: "
            f"{'; '.join(differences)}. Ask for what it serves, or unset {ENDPOINTS_ENV} to start a "
            "private service"
        )


def _hold_lock(path: str) -> int:
    """A flocked file kept open while the folder is in use: a service that starts on this host
    leaves the folder alone while it is held and removes it once its trainer is gone (NOTE
    [ Shared-memory cleanup ] in loader_service/shm.py)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class LocalService:
    """One private ``loader-service serve``, ready on ``endpoint`` once constructed (NOTE [ A private
    service ])."""

    def __init__(self, data: str | os.PathLike[str], options: Mapping[str, object], start_timeout: float):
        self.ready = False
        self.folder = tempfile.mkdtemp(prefix=f"dataferry-{os.getpid()}-local-")  # 0700: ours alone
        self._lock = _hold_lock(os.path.join(self.folder, "lock"))
        self.socket_path = os.path.join(self.folder, "service.sock")
        self.endpoint = f"ipc://{self.socket_path}"
        argv = [sys.executable, *SAFE_PATH, "-c", SERVICE_BOOT, "serve", "--data", os.fspath(data)]
        argv += ["--endpoint", self.endpoint, "--stop-with-stdin", *serve_flags(options)]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs:
            env = {k: v for k, v in os.environ.items() if k not in CHILD_UNSET}
            env[NOTIFY_FD_ENV] = str(theirs.fileno())
            try:
                # Its own session: a Ctrl-C meant for the trainer reaches the trainer, which then closes.
                self.process = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, env=env, start_new_session=True, pass_fds=(theirs.fileno(),)
                )
            except BaseException:
                self._remove_folder()
                raise
            theirs.close()  # the child's alone now: end of file here means it is gone
            try:
                self._wait_ready(ours, start_timeout)
                self._check_listener()
                self.ready = True
            except BaseException:
                self.stop()
                raise
        log.info("private service %d ready on %s", self.process.pid, self.endpoint)

    def _wait_ready(self, ready: socket.socket, timeout: float) -> None:
        ready.settimeout(POLL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                said = ready.recv(4096)
            except TimeoutError:
                said = None
            if said is not None and b"READY=1" in said.split(b"\n"):
                return
            if said == b"":  # end of file: the child is gone, or closed the channel it was given
                self._reap(POLL * 5)
                self.check()
                raise ServiceError("the private service closed its readiness channel without READY")
            self.check()
            if time.monotonic() > deadline:
                raise ServiceError(f"the private service was not ready within {timeout:.0f} s")

    def _check_listener(self) -> None:
        """The socket must be served by the child itself (NOTE [ A private service ])."""
        path = self.socket_path
        try:
            pid = listener_of(path).pid
        except OSError as exc:
            raise ServiceError(
                f"the private service said it was ready, but {path} does not answer: {exc}"
            ) from None
        if pid != self.process.pid:
            raise ServiceError(
                f"{path} is served by pid {pid}, not by the private service {self.process.pid}"
            )

    def _reap(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def check(self) -> None:
        """ServiceError with its exit code if the service has exited (the loader asks at every wait)."""
        code = self.process.poll()
        if code is not None:
            when = "while the loader used it" if self.ready else "before it was ready"
            raise ServiceError(
                f"the private service (pid {self.process.pid}) exited with code {code} {when}: "
                "its messages are above, on standard error"
            )

    def stop(self) -> int:
        """End of file on its stdin, the stop it is waiting for; SIGTERM, then SIGKILL, if it hangs.
        Its exit code (negative: the signal that ended it)."""
        process = self.process
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        for escalate in (None, process.terminate, process.kill):
            if escalate is not None:
                log.warning("private service %d did not stop; %s", process.pid, escalate.__name__)
                escalate()
            try:
                code = process.wait(STOP_TIMEOUT)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            code = process.wait()
        if code:
            log.warning("private service %d exited with code %d", process.pid, code)
        self._remove_folder()
        return code

    def _remove_folder(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._lock)
