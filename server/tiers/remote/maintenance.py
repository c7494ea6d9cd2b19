"""The remote tier's maintenance thread: TTLs given back to chunks read (`_touch` queues, `_send_touches`
sends), breakers of down nodes PINGed once their reset time passed, the slot map, RTT and INFO refreshed,
the password file read again; and the one start-up warning of a store that cannot evict."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import glide_sync as glide
from kvtier.server.tiers.networked.breaker import Breaker
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import PART_TTL_MARGIN_MS, parts_of
from kvtier.server.tiers.remote.nodes import Unavailable, denied

log = logging.getLogger("kvtier.server.remote")

REFRESH_FRACTION = 0.25  # a chunk read gets its TTL back at most once per this fraction of the TTL
REFRESH_MAX = 100_000  # chunks whose next TTL refresh time is remembered; the oldest go first
TOUCH_MAX = 100_000  # keys waiting for their TTL refresh (sent every TICK_S); more are not refreshed
TOUCH_BATCH = 1000  # PEXPIREs per pipeline
TICK_S = 0.25  # maintenance thread: how often open breakers are looked at
INFO_REFRESH_S = 5.0  # ... and how often INFO (used_memory, maxmemory), the slot map and the RTT are refreshed
PASSWORD_CHECK_S = 1.0  # ... and how often --remote-password-file is read for a new password


class Maintenance:
    """RemoteTier's maintenance methods (a part of the tier: the state is set by RemoteTier.__init__)."""

    def _read_password(self) -> str:
        """--remote-password-file's content less its trailing newline; ValueError when unreadable or empty."""
        try:
            password = Path(self.access.password_file).read_text().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--remote-password-file: {exc}") from None
        if not password:
            raise ValueError(f"--remote-password-file: {self.access.password_file} is empty")
        return password

    def _reload_password(self) -> None:
        """Maintenance thread: when --remote-password-file holds a new password, new clients use it and every
        open client takes it for its next authentication (its connections stay authenticated); a client that
        never connected cannot take it and is replaced at its thread's next call. One log line says whether
        the store accepts it (a fresh connection's PING)."""
        try:
            password = self._read_password()
        except ValueError as exc:
            if str(exc) != self._password_error:  # logged once per error, not every second
                log.warning("remote password not reloaded: %s", exc)
            self._password_error = str(exc)
            return
        self._password_error = ""
        if password == self._password:
            return
        with self._lock:
            self._password = password
            clients = list(self._clients)
        replaced = 0
        for client in clients:
            try:
                client.update_connection_password(password, immediate_auth=False)
            except glide.GlideError:  # never connected: it would connect with the old password
                replaced += 1
                with self._lock:
                    if client in self._clients:  # not closed by its thread meanwhile
                        self._stale.add(id(client))
        probe = self._connect(password, primary=True)
        level, verdict = logging.INFO, "the store accepts it"
        try:
            probe.custom_command(["PING"])
        except glide.GlideError as exc:
            level = logging.WARNING
            verdict = f"the store did not accept it ({str(exc).strip()}): reconnections fail until it does"
        finally:
            with contextlib.suppress(glide.GlideError):
                probe.close()
        log.log(level, "remote password changed in %s: %d open clients take it, %d are replaced; %s",
                self.access.password_file, len(clients) - replaced, replaced, verdict)

    def _touch(self, node: str, meta: ChunkMeta, gen: bytes) -> None:
        """Queue a chunk just read for its TTL back (parts, header, aliases), at most once per REFRESH_FRACTION
        of the TTL: so a chunk read now and then stays and an unread one expires. The maintenance thread
        sends them (`_send_touches`), off the read's path."""
        if not self.ttl_ms or self._no_expire:
            return
        now = time.monotonic()
        ttl, parts = self.ttl_ms, parts_of(meta.size)
        by_node = {node: [*((self._part_key(meta.ns, meta.key, gen, i), ttl + PART_TTL_MARGIN_MS)
                            for i in range(parts)), (self._key(meta.ns, meta.key, "h"), ttl)]}
        for where, items in self._aliases_by_node(meta).items():
            by_node.setdefault(where, []).extend((k, ttl) for k, _ in items)
        with self._lock:
            if self._refreshed.get(meta.key, 0.0) > now:
                return
            if sum(map(len, self._touches.values())) + parts + 1 + len(meta.aliases) > TOUCH_MAX:
                return  # the store is not keeping up: this one waits for a later read
            self._refreshed.pop(meta.key, None)
            self._refreshed[meta.key] = now + ttl / 1000 * REFRESH_FRACTION
            while len(self._refreshed) > REFRESH_MAX:
                self._refreshed.popitem(last=False)
            for where, items in by_node.items():
                self._touches.setdefault(where, []).extend(items)

    def _send_touches(self) -> None:
        """Maintenance thread: PEXPIRE the keys `_touch` queued, a non-atomic batch per node; best effort (a
        node that fails loses its batch). A store that refuses PEXPIRE (an ACL without it) is not asked
        again (logged once)."""
        with self._lock:
            touches, self._touches = self._touches, {}
        client = self._client()
        batches = [(where, items[i : i + TOUCH_BATCH]) for where, items in touches.items()
                   for i in range(0, len(items), TOUCH_BATCH)]
        for where, items in batches:
            def fill(batch: Any, items: list[tuple[str, int]] = items) -> None:
                for k, ms in items:
                    batch.pexpire(k, ms)

            try:
                results = self._call(where, "put", lambda fill=fill: self._batch(client, fill, 0))
            except (Unavailable, glide.RequestError):
                continue
            refusal = next((r for r in results if denied(r)), None)
            if refusal is not None:
                self._no_expire = True
                log.warning("remote store %s refused PEXPIRE (%s): chunks read keep the TTL they were written with "
                            "(the ACL of docs/remote.md grants it)", self.path, refusal)
                return

    def _warn_unbounded(self) -> None:
        """One WARNING line when a master's INFO memory shows a store that does not evict: no maxmemory (it
        grows until its host runs out), noeviction (full, it refuses writes), or volatile-* with no TTL."""
        unbounded = [n for n, (mem, _) in sorted(self._limits.items()) if not mem]
        stuck = [n for n, (mem, policy) in sorted(self._limits.items()) if mem and (
            policy == "noeviction" or (policy.startswith("volatile") and not self.ttl_ms))]
        why = ([f"no maxmemory on {', '.join(unbounded)}: it grows until the host runs out of memory "
                "(chunks go only by --remote-ttl-s)"] if unbounded else []) + (
               [f"maxmemory-policy evicts no kvtier chunk on {', '.join(stuck)}: once full it refuses writes "
                "(they pause with a back-off) until chunks expire"] if stuck else [])
        if why:
            log.warning("remote store %s: %s; set maxmemory and allkeys-lru (docs/remote.md)", self.path,
                        "; ".join(why))

    def _run_maintenance(self) -> None:
        """PING the nodes of open breakers once their reset time passed (an answer closes them); every
        INFO_REFRESH_S, refresh the slot map, the RTT and INFO; every PASSWORD_CHECK_S, read the password file."""
        last = checked = time.monotonic()
        while not self._stop.wait(TICK_S):
            if self._touches:
                try:
                    self._send_touches()
                except Exception:
                    log.exception("remote TTL refresh failed")
            if self.access.password_file and time.monotonic() - checked >= PASSWORD_CHECK_S:
                checked = time.monotonic()
                try:
                    self._reload_password()
                except Exception:  # the thread must survive it
                    log.exception("remote password reload failed")
            for node, brk in list(self._breakers.items()):
                if brk.open:
                    self._ping(node, brk)
            if time.monotonic() - last >= INFO_REFRESH_S:
                last = time.monotonic()
                try:
                    self._refresh()
                except Exception:
                    log.exception("remote refresh failed")

    def _ping(self, node: str, brk: Breaker) -> None:
        client = self._client()
        try:
            brk.call(lambda: self._on_node(client, node, ["PING"]))
        except Exception:  # still open (OpenedState until its reset time), or failed again
            return
        log.info("remote node %s answers again: its breaker closed", node)

