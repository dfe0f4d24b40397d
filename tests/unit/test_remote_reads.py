"""What a worker makes of a failed read from a store (NOTE [ Object store reads ]): the sample's fault
costs the sample; the store's makes the task wait, and a slow store still makes progress."""

from __future__ import annotations

import asyncio
import time

import pytest

from loader_service.dataset.storage.objectstore import NotFetched, Requests, StoreUnavailable, sample_error
from loader_service.dataset.tables import DecodeError

exceptions = pytest.importorskip("obstore.exceptions")
URL = "s3://bucket/shards/a.tar"


def _status(line: str) -> Exception:
    error: Exception = exceptions.GenericError(
        f"Generic S3 error: Server returned non-2xx status code: {line}: ..."
    )
    return error


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (FileNotFoundError("404"), "not found"),
        (exceptions.PreconditionError("412"), "changed since it was indexed"),
        (ValueError('illegal "." in path'), 'illegal "."'),
        (exceptions.PermissionDeniedError("403"), "403"),
        (_status("403 Forbidden"), "answered 403 Forbidden"),
        (_status("400 Bad Request"), "answered 400 Bad Request"),
        (_status("416 Range Not Satisfiable"), "answered 416"),
    ],
)
def test_what_asking_again_cannot_change_costs_the_sample(error: Exception, reason: str) -> None:
    found = sample_error(error, URL)
    assert isinstance(found, DecodeError) and URL in str(found) and reason in str(found)


@pytest.mark.parametrize(
    "error",
    [
        _status("503 Service Unavailable"),
        _status("500 Internal Server Error"),
        _status("429 Too Many Requests"),
        _status("408 Request Timeout"),
        exceptions.GenericError("Generic S3 error: error sending request for url (...)"),
    ],
)
def test_what_the_store_may_answer_later_makes_the_task_wait(error: Exception) -> None:
    assert isinstance(sample_error(error, URL), StoreUnavailable)


def test_reads_the_deadline_stopped_are_asked_again_and_none_at_all_is_the_store_down() -> None:
    requests = Requests(deadline=0.2)

    async def quick() -> str:
        return "data"

    async def stuck() -> str:
        await asyncio.sleep(30)
        return "never"

    try:
        started = time.monotonic()
        results = requests.run([quick, stuck, quick])
        assert results[0] == results[2] == "data" and isinstance(results[1], NotFetched)
        with pytest.raises(StoreUnavailable, match="no read finished within"):
            requests.run([stuck, stuck])
        assert time.monotonic() - started < 5, "a stuck read is cut at the deadline"
    finally:
        requests.close()
