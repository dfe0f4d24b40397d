"""What the workers' template imports once, so that every worker forked from it starts with it done.

Imported by multiprocessing's forkserver when it starts (``set_forkserver_preload``; NOTE [ Workers
from a template ] in supervisor/workers/pool.py), never by the service itself: the decode worker
module (numpy, OpenCV, ZeroMQ, the formats) and, for feeds with a ``--pipeline``, the pipelines
named in ``$DATAFERRY_TEMPLATE_PIPELINES`` (one a line: a spec holds a colon), after
``single_threaded`` (torch and the BLAS pools at one thread). A pipeline that imports torch then
costs its import once, and its
pages are shared by every worker; measured, a worker forked after the service had started took
over 3 s to be ready while it imported torch on a busy 2-core host. The workers import the
pipelines again through ``load_pipeline``, which finds them already loaded. A pipeline that fails
here is left to fail in the worker, which says why (NOTE [ Worker restarts ]).
"""

from __future__ import annotations

import gc
import logging
import os

from loader_service.decode import worker as _worker  # noqa: F401 - imported for the workers forked from here
from loader_service.decode.contract import PIPELINES_ENV, TEMPLATE_FOLDER_ENV, PipelineError
from loader_service.decode.pipeline import load_pipeline
from loader_service.working_folder import moved_to

log = logging.getLogger(__name__)


def _preload_pipelines() -> None:
    """Each pipeline, loaded from the service's working folder: a ``package.module:FUNC`` one is
    looked for there, as the workers look for it; this process runs in the service's private folder
    (NOTE [ Nothing from the working folder ]), where it is again afterwards."""
    working = os.environ.get(TEMPLATE_FOLDER_ENV) or "."
    for spec in filter(None, os.environ.get(PIPELINES_ENV, "").split("\n")):
        try:
            with moved_to(working):
                load_pipeline(spec)
        except (PipelineError, OSError) as exc:
            log.debug("template: %s", exc)


_preload_pipelines()
# What was imported stays out of the collector's sight: a collection in a worker would otherwise
# write to every page of it, copying the pages the workers share.
gc.freeze()
