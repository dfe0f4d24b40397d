"""What a worker makes of a failed read from a store (NOTE [ Object store reads ]): the sample's fault
costs the sample; the store's makes the task wait, and a slow store still makes progress."""

from __future__ import annotations

import asyncio
import time

import pytest

from loader_service.dataset.storage.objectfiles import Deferred, NotFetched, Requests, Window
from loader_service.dataset.storage.storeerrors import StoreUnavailable, sample_error
from protocol.pixels import DecodeError

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


def _verdicts(window: Window, asks: list[tuple[int, int | None, float]]) -> list[bool | None]:
    """Each read's answer, for reads that ask (position, size, after seconds) or settle having asked
    nothing (size None); None for a read never answered within a second."""

    async def one(position: int, size: int | None, delay: float) -> bool | None:
        await asyncio.sleep(delay)
        if size is None:
            window.settle(position)
            return None
        try:
            await asyncio.wait_for(window.admit(position, size), 1.0)
        except Deferred:
            return False
        except TimeoutError:
            return None
        return True

    async def all_of() -> list[bool | None]:
        return list(await asyncio.gather(*(one(*ask) for ask in asks)))

    return asyncio.run(all_of())


def test_a_window_lets_reads_hold_their_bytes_in_the_tasks_order_while_they_fit() -> None:
    """NOTE [ Prefetch budget ]: sizes learnt out of order are answered in order; the first read
    with no room, and every read after it, wait for the next window, whatever their size."""
    window = Window(5, budget=10)
    found = _verdicts(window, [(0, 4, 0.02), (1, 4, 0.0), (2, 4, 0.01), (3, 1, 0.0), (4, 1, 0.03)])
    assert found == [True, True, False, False, False]
    assert window.held == 8 and window.closed


def test_a_windows_first_read_holds_even_when_larger_than_the_budget() -> None:
    window = Window(2, budget=10)
    assert _verdicts(window, [(0, 25, 0.0), (1, 1, 0.0)]) == [True, False]
    assert window.held == 25, "one object alone may exceed the budget, no two"


def test_a_read_that_failed_before_asking_holds_nothing_and_stops_no_other() -> None:
    window = Window(3, budget=10)
    assert _verdicts(window, [(0, None, 0.01), (1, 6, 0.0), (2, 4, 0.0)]) == [None, True, True]
    assert window.held == 10 and not window.closed
