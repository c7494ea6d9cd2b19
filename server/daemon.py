"""The daemon's lifecycle: map L1 (adopting the one a previous daemon left, l1/adopt.py), serve ZeroMQ (and the
admin API) on one uvloop loop, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Protocol

import uvloop
import zmq
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.config import ServerConfig
from kvtier.server.eviction import make_policy
from kvtier.server.feed import Feed, FeedConfig
from kvtier.server.gpu_ops import GpuOps
from kvtier.server.l1.adopt import JOURNAL_SUFFIX, L1Files, open_l1
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.journal_records import half_bytes
from kvtier.server.l1.reconfig import set_quotas
from kvtier.server.l1.retention import HintBounds
from kvtier.server.metrics import FeedMetrics, GpuMetrics, Metrics
from kvtier.server.rpc import RequestHandler
from kvtier.server.tenant_tables import TenantTables
from kvtier.server.tier_setup import make_tiers, tier_options
from kvtier.server.transfer.copiers import Copiers, CopiersConfig
from kvtier.shm.client_lock import LockDirectory
from kvtier.shm.journal import journal_bytes
from kvtier.shm.presence import PresenceFile
from kvtier.shm.presence import file_bytes as presence_bytes
from kvtier.shm.segment import PRESENCE_NAME_SUFFIX, PairLock, check_space, tmpfs_options

log = logging.getLogger("kvtier.server")

SWEEP_INTERVAL_S = 0.5
DRAIN_BATCH = 64  # requests served per wake-up before yielding to the loop
# the socket calls' flags as plain ints: pyzmq's enum flag arithmetic costs ~1 us a call on the serving loop
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class Service(Protocol):
    """Something that runs on the daemon's loop beside the request port (the admin API)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Daemon:
    def __init__(self, config: ServerConfig, services: Sequence[Callable[[Daemon], Service]] = ()) -> None:
        self.config = config
        self._service_factories = list(services)
        self.metrics = Metrics()
        num_pages = config.l1_bytes // config.page_size
        self.pair = PairLock(config.segment_name, config.shm_dir)  # first: nothing is touched without it
        self.presence: PresenceFile | None = None
        try:
            check_space(config.shm_dir, l1_files(config))
            # made anew before L1's index is (adopted chunks included): one region for L1, one per lower tier
            self.presence = PresenceFile.create(config.segment_name + PRESENCE_NAME_SUFFIX,
                                                1 + len(tier_options(config)), config.shm_dir,
                                                int(config.shm_mode, 8), epoch=time.time_ns())
            self.l1 = open_l1(L1Files(config.segment_name, config.shm_dir, int(config.shm_mode, 8)), num_pages,
                              config.page_size, make_policy(config.eviction_policy), self.metrics,
                              adopt=config.l1_adopt, discard=config.l1_discard, quarantine_s=config.reservation_ttl_s,
                              index_observer=self.presence.writer(0))
        except BaseException:
            self._close_presence()
            self.pair.release()
            raise
        log.info("%s", self.l1.outcome)
        self.segment = self.l1.segment
        self.locks = LockDirectory(config.shm_dir, self.segment.name)
        self.locks.sweep()  # lock files of clients of an earlier server that died
        store = self.l1.store
        holds = Holds(store, self.metrics, lease_ttl_s=config.lease_ttl_s, reservation_ttl_s=config.reservation_ttl_s,
                      client_timeout_s=config.client_timeout_s, locks=self.locks, first_id=time.time_ns() // 1000,
                      hints=HintBounds(config.hint_max_retain_s, config.hint_max_sessions, config.hint_session_idle_s))
        try:
            self.cache = Cache(store, holds, self.metrics, make_tiers(config, store, self.segment.array(), self.metrics))
            self._observe_tiers()
            self.cache.open()  # lower tiers' index scans run before the server reports ready
        except BaseException:
            self._close_presence()
            self.l1.abandon()
            self.pair.release()
            raise
        l2 = self.cache.tier("l2")
        configured = {"l1": config.l1_tenant_quotas, **({"l2": config.l2_tenant_quotas} if l2 is not None else {})}
        self.tables = TenantTables.beside(config.shm_dir, self.segment.name, configured, keep=config.l1_adopt)
        self.tables.appliers["l1"] = partial(set_quotas, store)
        if l2 is not None:
            self.tables.appliers["l2"] = l2.tier.set_quotas  # FsTier.set_quotas: kept for a warm restart like L1's
        log.info("%s", self.tables.restore(config.l1_discard))
        for tier, text in list(self.tables.current.items()):
            try:
                self.tables.apply(tier, text)
            except ValueError as exc:  # a kept table the tier outgrew (L2 is resized across warm restarts)
                log.warning("the kept %s tenant quota table %r does not fit the tier now (%s): using the "
                            "configured one", tier, text, exc)
                self.tables.apply(tier, self.tables.configured[tier])
        # adopted chunks a lower tier may lack (the old daemon's write-behind queue died with it), oldest first
        self._adopted = list(store.entries.values()) if self.l1.adopted and self.cache.tiers else []
        self.gpu_metrics = GpuMetrics(self.metrics)
        self._copier_restarts: dict[str, int] = {}
        self.gpu = GpuOps(self.cache, Copiers(CopiersConfig(
            os.path.join(self.segment.directory, self.segment.name), self.segment.size, config.page_size,
            config.gpu_pin_piece_mb << 20, config.gpu_watchdog_s, config.gpu_op_timeout_s,
            max_copiers=config.gpu_max_copiers), self._copier_changed),
            self.gpu_metrics, self.segment.size, copy_timeout_s=config.gpu_op_timeout_s,
            allow_fake=config.gpu_fake_engine, allow_host=config.host_copies)
        # l1_backed: all of L1 is backed with memory (the prefault), so a client may map it all ahead
        segment_info = {"shm_name": self.segment.name, "shm_dir": config.shm_dir, "shm_size": self.segment.size,
                        "page_size": config.page_size, "l1_backed": config.l1_prefault}
        if self.presence is not None:  # only when authoritative: a client trusts its "not held"
            segment_info["presence"] = self.presence.name
        self.handler = RequestHandler(
            self.cache, segment_info, config.chunk_size, heartbeat_s=config.client_timeout_s / 3,
            token=config.admin_token, gpu=self.gpu,
        )
        self._stop = asyncio.Event()
        self._prefault_stop = threading.Event()
        self._signals = 0
        self.exit_code = 0

    async def serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        loop = asyncio.get_running_loop()
        self.cache.attach_loop(loop)
        feed: Feed | None = None
        rewrite = asyncio.ensure_future(self._write_behind_again()) if self._adopted else None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            for endpoint in self.config.endpoints:
                sock.bind(endpoint)
            feed = self._start_feed(loop)
            sweeper = asyncio.create_task(self._sweep())
            services = [make(self) for make in self._service_factories]
            for service in services:
                await service.start()
            log.info(
                "kvtier server ready: %s, L1 %.2f GiB in %s (tmpfs huge=%s), %d KiB pages, policy %s, pid %d",
                ", ".join(self.config.endpoints), self.segment.size / (1 << 30),
                os.path.join(self.config.shm_dir, self.segment.name),
                tmpfs_options(self.config.shm_dir).get("huge", "never"),
                self.config.page_size_kb, self.config.eviction_policy, os.getpid(),
            )
            prefault = self._start_prefault(loop)
            receiver = asyncio.create_task(self._receive(sock))
            await self._stop.wait()
            log.info("kvtier server stopping")
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
            sweeper.cancel()
            if rewrite is not None:
                rewrite.cancel()
            if prefault is not None:
                self._prefault_stop.set()
                prefault.join()
            for service in reversed(services):
                await service.stop()
            await self.gpu.engine.close()
            self.cache.close()
        finally:
            if feed is not None:
                feed.stop()
            sock.close(0)
            ctx.term()
            self._close_presence()
            outcome = self.l1.close()
            self.locks.sweep()
            self.pair.release(remove=True)
            log.info("kvtier server stopped; %s", outcome)

    def _observe_tiers(self) -> None:
        """Give each lower tier its region of the presence filter; when one has no local index to answer from
        (a remote tier), no filter: it could not say "not held"."""
        if self.presence is None:
            return
        accepted = [t.tier.observe_index(self.presence.writer(i)) for i, t in enumerate(self.cache.tiers, start=1)]
        if all(accepted):
            return
        log.info("no presence filter: the %s tier has no local index of what it holds",
                 next(t.tier.name for t, ok in zip(self.cache.tiers, accepted, strict=True) if not ok))
        for t in self.cache.tiers:
            t.tier.observe_index(None)
        self.cache.store.index.observe(None)
        self._close_presence()

    def _close_presence(self) -> None:
        """Mark the presence filter closed (clients mapping it ask the server again) and remove its file."""
        if self.presence is not None:
            self.presence.close()
            self.presence = None

    def _start_feed(self, loop: asyncio.AbstractEventLoop) -> Feed | None:
        """The daemon event feed (--events-endpoint), publishing from now on; None when off."""
        c = self.config
        if not c.events_endpoint:
            return None
        feed = Feed(self.cache.bus, FeedConfig(c.events_endpoint, c.events_replay_endpoint, c.events_buffer_batches,
                                               c.events_queue_depth), FeedMetrics(self.metrics), self.cache.held)
        feed.start(loop.call_soon_threadsafe)
        self.handler.events, self.handler.events_replay = c.events_endpoint, c.events_replay_endpoint
        return feed

    def _write_behind_again(self) -> Awaitable[None]:
        """The adopted chunks' write-behind (Cache.write_behind_again), started before any request is served;
        a failure is logged, not raised."""
        pending = self.cache.write_behind_again(self._adopted)
        self._adopted = []

        async def logged() -> None:
            try:
                await pending  # a cancel of this task cancels it
            except Exception:
                log.exception("write-behind after adoption failed")

        return logged()

    async def _receive(self, sock: zmq.Socket) -> None:
        """Serve requests from the socket's file descriptor until cancelled.

        Plain non-blocking socket calls from a reader callback, not zmq.asyncio futures: a future per
        message costs more than a whole lookup. The ZeroMQ FD only signals edges, so every wake-up drains
        what is queued (at most DRAIN_BATCH, then the rest on the next loop turn, so other work runs).
        A reply that must wait (an acquire of a chunk being promoted from L2) is sent by a task in `later`.
        """
        loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        later: set[asyncio.Task[None]] = set()
        loop.add_reader(fd, self._drain, sock, loop, later)
        try:
            self._drain(sock, loop, later)  # requests queued before the reader was added raise no edge
            await asyncio.Event().wait()
        finally:
            loop.remove_reader(fd)
            for task in later:
                task.cancel()

    def _drain(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop, later: set[asyncio.Task[None]]) -> None:
        handle = self.handler.handle
        for _ in range(DRAIN_BATCH):
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            frames = sock.recv_multipart(_NOBLOCK)
            if len(frames) != 2:
                self.metrics.malformed.inc()
                if not frames:
                    continue
                reply = p.pack(p.error(0, p.BAD_REQUEST, "a request is exactly one frame"))
            else:
                reply = handle(frames[0], frames[1])
            if isinstance(reply, bytes):
                with contextlib.suppress(zmq.Again):  # ROUTER drops what a gone peer cannot take
                    sock.send_multipart([frames[0], reply], _NOBLOCK)
            else:
                task = loop.create_task(self._send_later(sock, loop, later, frames[0], reply))
                later.add(task)
                task.add_done_callback(later.discard)
            self.cache.store.flush_touches()  # bookkeeping the reply did not need to wait for
        loop.call_soon(self._drain, sock, loop, later)

    async def _send_later(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop, later: set[asyncio.Task[None]],
                          ident: bytes, reply: Awaitable[bytes]) -> None:
        frame = await reply
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([ident, frame], zmq.NOBLOCK)
        self._drain(sock, loop, later)  # a send can consume the FD's edge: serve what arrived meanwhile

    def _start_prefault(self, loop: asyncio.AbstractEventLoop) -> threading.Thread | None:
        if not self.config.l1_prefault:
            return None
        self.cache.store.prefault = "running"
        thread = threading.Thread(target=self._prefault, args=(loop,), name="kvtier-l1-prefault", daemon=True)
        thread.start()
        return thread

    def _prefault(self, loop: asyncio.AbstractEventLoop) -> None:
        started = time.monotonic()
        try:
            finished = self.segment.prefault(self._prefault_stop, self._set_backed)
        except OSError as exc:  # the tmpfs filled since the start's check: a store would be SIGBUS
            self.cache.store.prefault = "failed"
            log.error("L1 prefault failed after %.2f GiB of %.2f GiB (%s): the tmpfs %s cannot back L1; stopping "
                      "(docs/operations.md, \"Sizing the shared-memory directory\")",
                      self.cache.store.backed_bytes / (1 << 30), self.segment.size / (1 << 30), exc.strerror,
                      self.config.shm_dir)
            self.exit_code = 1
            loop.call_soon_threadsafe(self._stop.set)
            return
        self.cache.store.prefault = "done" if finished else "stopped"
        if finished:
            log.info("L1 backed by memory: %.2f GiB in %.1f s", self.segment.size / (1 << 30),
                     time.monotonic() - started)

    def _copier_changed(self, copier: dict) -> None:
        self.gpu_metrics.pinned_bytes.labels(copier["device"]).set(copier["pinned_bytes"])
        seen = self._copier_restarts.get(copier["device"], 0)
        if copier["restarts"] > seen:
            self.gpu_metrics.copier_restarts.labels(copier["device"]).inc(copier["restarts"] - seen)
            self._copier_restarts[copier["device"]] = copier["restarts"]

    def _set_backed(self, nbytes: int) -> None:
        self.cache.store.backed_bytes = nbytes

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                self.cache.holds.sweep()
            except Exception:  # keep sweeping; a bug here must not stop reclamation
                log.exception("sweep failed")


    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now")
            with contextlib.suppress(Exception):
                self.l1.abandon()  # a journaled L1 stays adoptable: its journal is current
            os._exit(1)
        log.info("received %s", signal.Signals(sig).name)
        self._stop.set()


def l1_files(config: ServerConfig) -> dict[str, int]:
    """The files L1 needs in --shm-dir at full size (name -> bytes): the segment, its presence filter (4 MiB a
    local tier), and its journal unless --no-l1-adopt (docs/operations.md, "Sizing the shared-memory
    directory")."""
    num_pages = config.l1_bytes // config.page_size
    files = {config.segment_name: num_pages * config.page_size,
             config.segment_name + PRESENCE_NAME_SUFFIX: presence_bytes(1 + len(tier_options(config)))}
    if config.l1_adopt:
        files[config.segment_name + JOURNAL_SUFFIX] = journal_bytes(half_bytes(num_pages, config.page_size,
                                                                               p.MIN_BLOCK_BYTES))
    return files


def run(config: ServerConfig, services: Sequence[Callable[[Daemon], Service]] = ()) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    daemon = Daemon(config, services)
    uvloop.run(daemon.serve())
    return daemon.exit_code
