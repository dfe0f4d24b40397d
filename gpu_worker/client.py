"""``ServiceLoader``: the trainer's loop over a service feed, a drop-in for a DataLoader loop.

    with ServiceLoader("ipc:///run/dataferry/train.sock", device="auto") as loader:
        for epoch in range(10):
            for images, labels in loader:   # a Batch unpacks as its fields, in the feed's order
                ...

Several endpoints make a fleet: each batch of the trainer's share is decoded by one of them (NOTE
[ A fleet ] in ``gpu_worker/fleet_pass.py``). Split as torch's DataLoader is: this class holds the
configuration and the public API; ``gpu_worker.fleet`` the sessions (one non-blocking
``Connection`` per service, one poller, one heartbeat thread); ``gpu_worker.passes`` the state of
one pass over an epoch. The leases the loop holds and their releases are ``gpu_worker.leases``; what
the loop receives is ``gpu_worker.batch``. Only the iterating thread touches the sockets: it sends
releases, starts and wants, and again whatever a socket refused, at every wait (NOTE [ Releases
that could not be sent ]). A lost service is taken back as NOTE [ Reconnecting ] in
``gpu_worker/connection.py`` says; a weighted job's weight changes are NOTE [ Weight changes ] in
``gpu_worker/weighting.py``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from gpu_worker.batch import Batch
from gpu_worker.checkpoint import Resume, resume_from, state_at
from gpu_worker.connection import ServiceError, ServiceTimeout, make_hello
from gpu_worker.device import resolve_device
from gpu_worker.fields import ExpectedFields, as_expected, expected_fields, field_differences
from gpu_worker.fleet import Fleet
from gpu_worker.loader_config import GROUP_SECRET_ENV, LoaderConfig, endpoints_of, shard_of
from gpu_worker.local import START_TIMEOUT, LocalService, check_shared, expected_option, unless_shared
from gpu_worker.passes import EpochPass, PassSettings, make_pass
from gpu_worker.service import Service
from gpu_worker.weighting import WeightChanges, source_stats
from protocol.curve import ClientKeys, warn_if_in_the_clear
from protocol.encoded import MAX_SHARE
from protocol.layout import SlotLayout, describe_fields
from protocol.messages import MAX_EPOCH, FeedInfo
from protocol.shares import consumed, rank_batches
from protocol.verdict import verdict, wait_share
from protocol.weights import ordered_weights

log = logging.getLogger(__name__)
__all__ = ["Batch", "LoaderConfig", "ServiceError", "ServiceLoader", "ServiceTimeout"]


class ServiceLoader:
    """Attach to a loader service feed (or a fleet of them); iterate once per epoch. See the module
    docstring."""

    def __init__(
        self,
        endpoint: str | Sequence[str] | None = None,
        *,
        device: str = "cpu",
        feed: str = "",
        mode: str = "shard",
        rank: int | None = None,
        world_size: int | None = None,
        remainder: str = "pad",
        group: str = "default",
        group_size: int = 1,
        batch_size: int | None = None,
        image_size: int | None = None,
        credits: int = 6,
        timeout: float = 60.0,
        connect_timeout: float = 30.0,
        transport: str = "auto",
        server_key: str | None = None,
        client_key: str | None = None,
        fields: ExpectedFields | None = None,
        group_secret: str | None = None,
        resolve_interval: float = 5.0,
        weights: Mapping[str, float] | None = None,
        epoch_samples: int = 0,
        decode: str | None = None,
        decode_threads: int = 1,
        _private: LocalService | None = None,
    ) -> None:
        """``endpoint``: one service, or several (a fleet, NOTE [ A fleet ]); ``DATAFERRY_ENDPOINTS``
        (comma-separated), when set, takes the place of what the code names.
        ``fields``: what the trainer expects each batch to hold, e.g. ``{"image": ((3, 224, 224),
        torch.uint8), "label": ((), torch.int64)}``; a feed that serves anything else (missing, extra,
        shape, dtype or order) raises ServiceError naming every difference before any batch.
        ``group_secret`` (default: ``DATAFERRY_GROUP_SECRET``): a broadcast group is its name among the
        trainers that share this secret, so others on the service can neither join it nor hold it up.
        An endpoint ``tcp://NAME:PORT`` whose NAME is a host name (a Kubernetes headless Service) is
        a fleet of every address NAME resolves to, looked up again every ``resolve_interval``
        seconds (0: once): addresses that appear join the epoch under way, gone ones leave it
        (NOTE [ A fleet from a name ] in gpu_worker/names.py). ``weights`` (by source name, every
        source of the feed named) mixes a feed of several sources by weight, in epochs of
        ``epoch_samples`` (0: the feed's size; NOTE [ Mixture order ] in
        loader_service/dataset/mixture.py); the service refuses weights it cannot serve, naming why.
        ``decode``: who decodes the JPEGs the service can send as they are (NOTE [ Encoded rows ] in
        protocol/encoded.py): ``"service"``, ``"trainer"`` (in ``decode_threads`` threads of this
        process, with the service's own code: the same pixels) or ``"auto"``, a share found while
        the loop runs (NOTE [ Finding the split ] in gpu_worker/split.py); default ``"service"``
        (``"auto"`` is to become the default on a CUDA device once the GPU decoder has run on a
        GPU: issue 46). ``"trainer"`` of a feed that sends no encoded rows raises ServiceError
        naming both.
        ``_private`` is ``local``'s: the service it started, watched at every wait and stopped by
        ``close``."""
        rank, world_size = shard_of(mode, rank, world_size)
        self.config = LoaderConfig(
            endpoints_of(endpoint),
            device=device,
            feed=feed,
            credits=credits,
            timeout=timeout,
            connect_timeout=connect_timeout,
            mode=mode,
            rank=rank,
            world_size=world_size,
            remainder=remainder,
            group=group,
            group_size=group_size,
            batch_size=batch_size or 0,
            image_size=image_size or 0,
            transport=transport,
            fields=() if fields is None else expected_fields(fields),
            group_secret=os.environ.get(GROUP_SECRET_ENV, "") if group_secret is None else group_secret,
            resolve_interval=resolve_interval,
            weights=tuple(weights.items()) if weights else (),
            epoch_samples=epoch_samples,
            decode=decode or "service",
            decode_threads=decode_threads,
        ).validated()
        cfg = self.config
        keys = ClientKeys.load(server_key, client_key)
        for each in cfg.endpoints:
            warn_if_in_the_clear(each, keys)
        self.device = resolve_device(device)
        self._resume: Resume | None = None
        self._next_epoch = 0
        self._pass: EpochPass | None = None
        self._changes = WeightChanges()
        """A weighted job's weight changes (NOTE [ Weight changes ])."""
        self._counts: Counter[str] = Counter()
        """``EpochPass.counts`` of the passes before the current one."""
        self._closed = False
        self._private = _private
        """The service ``local`` started for this loader, stopped by ``close``."""
        hello = make_hello(**cfg.hello_fields(), encode=MAX_SHARE if cfg.decode == "trainer" else 0)
        watch = None if _private is None else _private.check  # NOTE [ A private service ]
        self._fleet = Fleet(cfg, hello, keys, self.device, watch)
        try:
            self._fleet.attach(cfg.connect_timeout)
            self._check_fields()
            self._check_decode()
        except BaseException:
            self.close()
            raise

    @classmethod
    def local(
        cls,
        data: str | os.PathLike[str],
        *,
        device: str = "cpu",
        feed: str = "",
        credits: int = 6,
        timeout: float = 60.0,
        fields: ExpectedFields | None = None,
        start_timeout: float = START_TIMEOUT,
        decode: str | None = None,
        decode_threads: int = 1,
        **serve_options: object,
    ) -> ServiceLoader:
        """A loader over a private service of its own: ``loader-service serve --data DATA`` with
        ``serve_options`` as its flags (``batch_size=64`` is ``--batch-size 64``; workers sized to
        this host unless ``workers=`` pins them; ``feed`` names its feed). The service stops when
        the loader closes, and when this process ends however it ends, SIGKILL included (NOTE
        [ Stop with stdin ]). Where ``DATAFERRY_ENDPOINTS`` is set, no service is started: the
        loader attaches to ``feed`` of those, so a script moves to a shared service without a
        change, and fails before any batch, naming each difference, if that feed serves other data
        or batches than asked: ``data``, ``batch_size`` and ``image_size``, ``seed``, ``augment``,
        ``interpolation``, ``pipeline`` where given (NOTE [ A shared service for a local call ])."""
        batch_size, image_size = (expected_option(serve_options, key) for key in ("batch_size", "image_size"))
        private = unless_shared(data, {**serve_options, "feed": feed or None}, start_timeout)
        endpoint = None if private is None else private.endpoint
        loader: ServiceLoader | None = None
        try:
            loader = cls(
                endpoint,
                device=device,
                feed=feed,
                batch_size=batch_size,
                image_size=image_size,
                credits=credits,
                timeout=timeout,
                fields=fields,
                decode=decode,
                decode_threads=decode_threads,
                _private=private,
            )
            if private is None:
                check_shared(loader.info, data, serve_options)
            return loader
        except BaseException:
            if loader is not None:
                loader.close()  # the private service with it
            elif private is not None:
                private.stop()
            raise

    # --- public API -----------------------------------------------------------------------------

    @property
    def info(self) -> FeedInfo:
        """The feed every service of the loader serves."""
        assert self._fleet.reference is not None
        return self._fleet.reference

    @property
    def sources(self) -> tuple[str, ...]:
        """The feed's sources in the order ``batch.sources`` numbers them: the names ``--source``
        gave, or ``("data",)`` for a feed of ``--data``."""
        return self.info.sources or ("data",)

    def __len__(self) -> int:
        """Batches per epoch for this trainer (its shard's share in shard mode)."""
        return self._first.batches

    @property
    def _first(self) -> Service:
        """A service that answered (they agree on everything the loop sees: NOTE [ A fleet ])."""
        return next(s for s in self._fleet.services if s.info is not None and not s.refused)

    @property
    def layout(self) -> SlotLayout:
        """The feed's batch layout: its fields (``protocol.layout.FieldSpec``) and their place in a slot."""
        return self._first.delivery.layout

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What each batch holds, in order: name -> (shape of one sample, dtype), as ``fields=`` takes."""
        return as_expected(self.layout.fields)

    @property
    def transport(self) -> str:
        """How batches arrive from the first service: ``shm`` (the slot mapped in place) or ``tcp``."""
        return self._first.delivery.transport

    @property
    def last_endpoint(self) -> str:
        """The endpoint of the service that delivered the batch handed out last."""
        return self._pass.last_endpoint if self._pass is not None else ""

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` delivers (like DistributedSampler.set_epoch).

        NOTE [ Resume through set_epoch ]
            A loop written for DistributedSampler calls ``set_epoch(epoch)`` at the top of every
            epoch, the resumed one included, after ``load_state_dict``. A resume point loaded for
            that very epoch is kept, so the loop continues where the state was taken; one for
            another epoch is dropped with a warning that says which, since the caller then asked
            for an epoch the state does not describe.
        """
        if type(epoch) is not int or not 0 <= epoch < MAX_EPOCH:
            raise ValueError(f"epoch must be an integer in [0, {MAX_EPOCH}), got {epoch!r}")
        resume = self._resume
        if resume is not None and resume.epoch == epoch:
            return
        if resume is not None:
            log.warning(
                "set_epoch(%d) drops the resume point loaded for epoch %d (batch %d, offset %d): "
                "epoch %d is delivered from its start",
                epoch,
                resume.epoch,
                resume.position,
                resume.offset,
                epoch,
            )
        self._next_epoch = epoch
        self._resume = None

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise ServiceError("this ServiceLoader is closed")
        epoch, position, offset = self._resume or Resume(self._next_epoch)
        self._resume = None
        self._next_epoch = epoch + 1
        if self._pass is not None:
            self._counts += self._pass.counts()
        cfg = self.config
        empty = cfg.mode == "shard" and cfg.world_size > 1  # NOTE [ Empty batches ]
        batches = self._batches(offset)
        settings = PassSettings(epoch, position, batches, cfg.timeout, empty, offset, self._changes.changes)
        self._pass = make_pass(self._fleet, settings, broadcast=cfg.mode == "broadcast")
        return iter(self._pass)

    def set_weights(self, weights: Mapping[str, float], at_batch: int) -> None:
        """Mix by ``weights`` from this rank's batch ``at_batch`` of the current pass on; every rank
        calls it with the same arguments, as ``set_epoch`` (NOTE [ Weight changes ] in
        gpu_worker/weighting.py). ValueError naming what is wrong: a loader without ``weights=``,
        a batch already past or past the pass, weights that are not one number >= 0 per source."""
        if not self.config.weights or self.config.mode != "shard":
            raise ValueError("set_weights is for a shard loader made with weights=")
        where = self._where()
        batches = self._batches(where.offset)
        if type(at_batch) is not int or not 0 <= at_batch < batches:
            raise ValueError(f"at_batch must be a batch of this pass, in [0, {batches}), got {at_batch!r}")
        ordered = ordered_weights(weights, self.sources)
        self._changes = self._changes.then(self._sample(where, at_batch), ordered, self._sample(where))
        if self._pass is not None and self._pass.active:
            self._pass.replan(self._changes.changes)

    def _sample(self, where: Resume, batch: int | None = None) -> int:
        """The run's global position of ``batch`` (default: ``where``'s) of ``where``'s pass."""
        info, at = self.info, where.position if batch is None else batch
        inside = consumed(where.offset, at, info.batch_size, self.config.world_size, info.samples)
        return where.epoch * info.samples + inside

    def stats(self) -> dict[str, Any]:
        """Per service: batches and images it delivered to the loop, images/s while it did, and
        whether it is in use; how many batches were assigned again after a service was lost, and
        asked of a second service while the loop waited on a slow one; how many batches had no
        sample left (NOTE [ Empty batches ] in gpu_worker/passes.py); the seconds the loop spent
        blocked in ``next()`` and computing between pulls (NOTE [ Exposed wait ] in
        gpu_worker/loop_clock.py), their wait share and verdict (NOTE [ Input-bound verdict ]), and
        the last whole epoch's (``gpu_worker/epoch_report.py``); per source of a feed of several,
        its rows, their share and the share asked for now (``source_stats``); who decoded the rows
        (``decode``: rows this process decoded and the service's, ms per image here, the share now,
        rows that could not be decoded: NOTE [ Finding the split ] in gpu_worker/split.py)."""
        counts = self._counts + (self._pass.counts() if self._pass is not None else Counter())
        waited, computed = self._fleet.clock.totals()
        cfg, info = self.config, self.info
        first = ordered_weights(dict(cfg.weights), self.sources) if cfg.weights else info.source_sizes
        asked = self._changes.asked(first or (1.0,), self._sample(self._where()))
        return {
            "endpoints": self._fleet.endpoint_stats(),
            **{key: counts[key] for key in ("reassigned", "backups", "empty")},
            "waited_s": round(waited, 3),
            "computed_s": round(computed, 3),
            "sources": source_stats(self.sources, self._fleet.by_source, asked),
            "wait_share": round(wait_share(waited, computed), 4),
            "verdict": verdict(wait_share(waited, computed)),
            "epoch": None if self._fleet.last_epoch is None else self._fleet.last_epoch.stats(),
            "decode": self._fleet.decoder.stats(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this trainer is: JSON-serialisable, small; ``load_state_dict`` continues from here.

        In shard mode it names how much of the epoch's order the whole job has taken
        (``consumed``, NOTE [ Elastic epochs ] in protocol/shares.py), not this rank's place: any
        rank's state resumes every rank of a job of any world size, as Accelerate and Lightning
        load the main process's copy on every rank. In broadcast mode it names the batches of the
        epoch already handed to the loop (``position``). A checkpoint taken after a step resumes
        with the next batch. It names no service: a state taken with one fleet resumes on any
        other serving the same feed.
        """
        cfg = self.config
        return {**state_at(self._where(), self.info, cfg.mode, cfg.world_size), **self._changes.state()}

    def _where(self) -> Resume:
        """The epoch, position and offset the next batch of the loop comes from."""
        current = self._pass
        if self._resume is not None:
            return self._resume
        if current is not None and current.active and current.position < current.batches:
            return Resume(current.epoch, current.position, current.offset)
        return Resume(self._next_epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``, whichever rank and world size saved it
        (shard mode); refuse a state from another feed or setup, naming what differs. States of
        version 1 (rank-bound) load too: their ranks moved in step, so they name a prefix as well."""
        cfg = self.config
        resume = resume_from(state, self.info, cfg.mode, cfg.world_size, len(self))
        self._changes = WeightChanges.from_state(state, len(self.sources))
        self._resume, self._next_epoch = resume, resume.epoch

    def _batches(self, offset: int) -> int:
        """This rank's batches of an epoch shared out from ``offset`` on."""
        if not offset:
            return len(self)
        cfg = self.config
        return rank_batches(self.info.samples, self.info.batch_size, cfg.world_size, cfg.remainder, offset)

    def __enter__(self) -> ServiceLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Leave the services. Batches still held must not be used afterwards: their slots are reused."""
        if self._closed:
            return
        self._closed = True
        held = sum(s.leases.held() for s in self._fleet.services)
        if held:
            log.warning("closing with %d batches still referenced", held)
        self._fleet.close()
        if self._private is not None:
            self._private.stop()

    def _check_decode(self) -> None:
        """``decode="trainer"`` of a feed that sends no encoded rows: an error naming both, before
        any batch (NOTE [ Encoded rows ])."""
        if self.config.decode != "trainer":
            return
        if self._fleet.decoder.unable:
            raise ServiceError(
                f"decode='trainer': this trainer cannot decode encoded rows: {self._fleet.decoder.unable}"
            )
        none = [s.endpoint for s in self._fleet.services if s.info is not None and not s.info.encoded]
        if none:
            raise ServiceError(
                f"decode='trainer': feed {self.info.name!r} at {', '.join(none)} sends no encoded rows "
                "(it offers them for the built-in train or eval transform with the region decoder, "
                "unless started with --encoded-row-bytes 0); use decode='service' or 'auto'"
            )

    def _check_fields(self) -> None:
        """Refuse a feed whose fields are not the ones this trainer stated (``fields=``); no start
        has been sent yet, so no batch has been taken."""
        differences = field_differences(self.config.fields, self.layout.fields) if self.config.fields else []
        if differences:
            raise ServiceError(
                f"feed {self.info.name!r} does not serve the fields this trainer expects: "
                f"{'; '.join(differences)} (it serves {describe_fields(self.layout.fields)})"
            )
