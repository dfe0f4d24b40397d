"""What the service knows about one attached trainer: its epoch plan, credits and leases."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Session:
    """One trainer connection (one ``ServiceLoader``), keyed by its ZeroMQ routing id.

    Credits bound everything the service has committed to this trainer: batches being filled, batches
    ready but not yet announced, and batches announced but not yet released. Production stops at the
    window, so a slow or stalled trainer holds at most ``credits`` slots of the pool.
    """

    routing_id: bytes
    session_id: str
    client: str
    credits: int
    last_seen: float
    run: int = -1
    epoch: int = 0
    next_produce: int = 0
    next_send: int = 0
    end: int = 0
    end_sent: bool = True
    filling: int = 0
    ready: dict[int, tuple[int, int]] = field(default_factory=dict)
    """seq -> (slot, count) of finished batches waiting for their turn."""
    leases: dict[int, int] = field(default_factory=dict)
    """lease id -> slot of announced, unreleased batches."""
    delivered: int = 0

    @property
    def in_flight(self) -> int:
        return self.filling + len(self.ready) + len(self.leases)

    def wants_batch(self) -> bool:
        return self.run >= 0 and self.next_produce < self.end and self.in_flight < self.credits

    def begin(self, run: int, epoch: int, position: int, end: int) -> None:
        """Start (or restart) an epoch; the caller has already cancelled the previous run's slots."""
        self.run, self.epoch, self.end = run, epoch, end
        self.next_produce = self.next_send = min(position, end)
        self.end_sent = False
        self.filling = 0
