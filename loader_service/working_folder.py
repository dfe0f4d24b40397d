"""The process's working folder, moved for a moment: where a ``python -c`` child looks first for imports.

NOTE [ Nothing from the working folder ]
    A service may run in a folder other users can write in (``loader-service serve`` or ``demo``
    started from /tmp; a trainer's private service starts in the trainer's), and nothing planted
    there may run as the service's user in any process of ours. The console scripts keep that
    folder off their own path; but ``python -c`` and ``python -m`` put it first (``''``, or its
    name), so a ``multiprocessing`` or ``loader_service`` package left there is the first import
    of such a child (a review's re-ran the real service on other data: the trainer trained on white
    images). Python 3.11's ``-P`` leaves the folder out, but multiprocessing passes it on only from
    a process that ran with it, and 3.10 has no such flag. So:
    * multiprocessing's ``-c`` children, the resource tracker and the decode workers' template
      (``from multiprocessing.forkserver import main``), start with the service in its private
      runtime folder (0700, its user's alone) for that moment (``start_from`` in
      supervisor/workers/template.py): their ``''`` is that folder for their whole life. The
      moment ends before the worker that needed them starts, so the workers, which multiprocessing
      moves to the service's working folder, and their pipelines see the folder the user started
      in, relative paths and all. One that died is started again the same way before the next
      worker. The service's other threads run meanwhile, and none resolves a relative path once
      started: the data, pipeline files and the cache folder are made absolute by the config, the
      keys folder (re-read on SIGHUP) at start-up, and a relative endpoint is released at shutdown
      once that thread is joined. Multiprocessing could still start one itself, from the working
      folder, if it died in the instant between the look and the worker's start (no other user
      can signal them; the OOM killer could, and so could the service itself, killing a template
      that stopped answering in that instant: NOTE [ A template that does not answer ]);
    * a ``package.module:FUNC`` pipeline is looked for in the working folder, first on the path, as
      ``python -m`` would: the user named it there, and trusts that folder as the code it holds.
      The template loads it from the folder in ``$DATAFERRY_TEMPLATE_FOLDER``, the workers and the
      probe from their own; a ``FILE.py:FUNC`` one puts only its file's folder on the path;
    * the pipeline probe drops the folder ``-c`` puts first (``CHILD_BOOT`` in decode/probe.py),
      and so does a trainer's private service (``SERVICE_BOOT``: NOTE [ A private service ] in
      gpu_worker/local.py);
    * ``loader-service demo`` runs in a private folder of its own: its sample-making processes,
      service and trainer start there (tools/demo.py).
    The way back from a moment elsewhere is a descriptor of the folder, not its name, which another
    user could replace meanwhile (``moved_to``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def moved_to(folder: str | Path) -> Iterator[None]:
    """This process in ``folder`` for the block, and back after it in the very folder it was in.

    A process has one working folder for all its threads: a relative path another thread resolves
    meanwhile resolves in ``folder`` (NOTE [ Nothing from the working folder ])."""
    back = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.chdir(folder)
        yield
    finally:
        os.fchdir(back)
        os.close(back)
