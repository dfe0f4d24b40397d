"""Bounds on what trainer connections may cost the service: messages per second, each and together.

A peer over the limit is not answered: its excess messages are dropped before they are decoded,
counted, and logged at most a few times a minute.
"""

from __future__ import annotations

from dataclasses import dataclass

MESSAGES_PER_SECOND = 1000.0
"""Sustained rate per connection: a trainer sends a release per batch and a heartbeat per second."""
BYTES_PER_MESSAGE = 256
"""A message costs one more for every this many bytes it has: what the main loop spends on one
grows with its size (a release of 4096 leases, 37 KB, takes 200 us to decode where a heartbeat
takes 1.4 us), so a session counted by messages alone could keep the loop's core busy inside its
rate with maximal releases and acks. Counted by size, such a message costs 145 of the 1000 a
second; a trainer's usual messages (a few leases, a heartbeat) stay under 256 bytes, cost 1."""
BURST = 2000.0
ALL_MESSAGES_PER_SECOND = 20_000.0
"""Sustained rate over all connections without a session together (fifty connections used to get
fifty times the per-connection rate); those with one are bounded by ``--max-sessions`` instead."""
ALL_BURST = 40_000.0
FORGET_AFTER = 60.0
"""Seconds after which an idle connection's bucket is forgotten (it restarts full)."""
MAX_BUCKETS = 10_000


@dataclass
class _Bucket:
    tokens: float
    last: float


class RateGate:
    """A token bucket per routing id, and one over all of them."""

    def __init__(
        self,
        rate: float = MESSAGES_PER_SECOND,
        burst: float = BURST,
        all_rate: float = ALL_MESSAGES_PER_SECOND,
        all_burst: float = ALL_BURST,
    ) -> None:
        self._rate = rate
        self._burst = burst
        self._all_rate = all_rate
        self._all = _Bucket(all_burst, 0.0)
        self._all_burst = all_burst
        self._buckets: dict[bytes, _Bucket] = {}
        self.dropped = 0

    def admit(self, peer: bytes, now: float, established: bool = False, size: int = 0) -> bool:
        """Take one message of ``size`` bytes from ``peer`` (``BYTES_PER_MESSAGE``). ``established``:
        the connection carries a session (or its heartbeats), so only its own bucket applies:
        connections nobody has vouched for share the budget over all connections, and cannot
        starve the trainers by flooding it."""
        cost = 1.0 + size // BYTES_PER_MESSAGE
        bucket = self._buckets.get(peer)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_idle(now)
            bucket = self._buckets[peer] = _Bucket(self._burst, now)
        _refill(bucket, now, self._rate, self._burst)
        _refill(self._all, now, self._all_rate, self._all_burst)
        if bucket.tokens < cost or (not established and self._all.tokens < cost):
            self.dropped += 1
            return False
        bucket.tokens -= cost
        if not established:
            self._all.tokens -= cost
        return True

    def _forget_idle(self, now: float) -> None:
        idle = [peer for peer, b in self._buckets.items() if now - b.last > FORGET_AFTER]
        for peer in idle:
            del self._buckets[peer]
        if len(self._buckets) >= MAX_BUCKETS:  # all busy: an attack with many connections
            self._buckets.clear()


def _refill(bucket: _Bucket, now: float, rate: float, burst: float) -> None:
    bucket.tokens = min(burst, bucket.tokens + max(0.0, now - bucket.last) * rate)
    bucket.last = now
