"""The trainer's lease book: releases the socket refused are kept, merged and sent once."""

from __future__ import annotations

import gc

from gpu_worker.leases import MAX_UNSENT, LeaseBook
from protocol.messages import MAX_RELEASES, Release


class Socket:
    """Stands in for ``Connection.send``: records what it accepts, refuses while ``full``."""

    def __init__(self) -> None:
        self.full = False
        self.sent: list[tuple[int, ...]] = []

    def send(self, msg: Release) -> bool:
        if not self.full:
            self.sent.append(msg.leases)
        return not self.full


class Slot:
    """Something a finalizer can watch, like the slot buffer a batch views."""


def test_refused_releases_are_merged_into_the_next_message() -> None:
    book, sock = LeaseBook(), Socket()
    sock.full = True
    book.let_go((1, 10))
    book.flush(1, sock.send)
    book.let_go((1, 11))
    book.flush(1, sock.send)
    assert book.pending and sock.sent == []
    sock.full = False
    book.flush(1, sock.send)
    assert sock.sent == [(10, 11)] and not book.pending
    book.flush(1, sock.send)
    assert sock.sent == [(10, 11)], "sent once"


def test_leases_of_a_lost_session_are_never_sent_to_the_next() -> None:
    book, sock = LeaseBook(), Socket()
    sock.full = True
    book.let_go((1, 10))
    book.flush(1, sock.send)
    book.let_go((1, 11))  # let go after the session was lost
    sock.full = False
    book.flush(2, sock.send)
    assert sock.sent == [] and not book.pending


def test_a_resume_drops_what_the_service_returned_and_keeps_what_it_kept() -> None:
    book, sock = LeaseBook(), Socket()
    slots = [Slot() for _ in range(3)]
    for lease in range(3):
        book.watch(slots[lease], (1, lease))
    sock.full = True
    del slots[0]  # let go while the service is unreachable: refused, kept
    gc.collect()
    book.flush(1, sock.send)
    assert sorted(book.held_ids(1)) == [1, 2]
    book.resumed(1, (1, 2))  # the service returned lease 0 itself
    sock.full = False
    slots.clear()  # the finalizers made before the resume still reach the book
    gc.collect()
    book.flush(1, sock.send)
    assert sorted(lease for leases in sock.sent for lease in leases) == [1, 2]
    assert book.held() == 0


def test_a_service_sending_more_than_granted_cannot_grow_the_book_without_bound() -> None:
    book, sock = LeaseBook(), Socket()
    sock.full = True
    for lease in range(MAX_UNSENT + 10):
        book.let_go((1, lease))
    book.flush(1, sock.send)
    sock.full = False
    book.flush(1, sock.send)
    assert len(sock.sent) == 1, "one message carries every kept release"
    assert len(sock.sent[0]) == MAX_UNSENT <= MAX_RELEASES
    assert sock.sent[0][0] == 10, "the oldest are dropped, the newest kept"
