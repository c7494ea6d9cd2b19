"""The remote tier's reads (`get`, promotion threads): the parts in MGETs straight into the L1 pages, the
header with the first ones when a probe saw the chunk's generation, sizes and checksum verified; a chunk
that cannot be served is forgotten, counted and deleted once (`_lost`), its generation ignored a while."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import glide_sync as glide
from kvtier.server.events import Removed
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk, decode_header
from kvtier.server.tiers.remote.layout import GEN_BYTES, GROUP_PARTS, PART_BYTES, pieces, verified
from kvtier.server.tiers.remote.nodes import ASSUMED_BYTES_PER_S, OVERFLOW, TIMEOUT_FACTOR, Unavailable

log = logging.getLogger("kvtier.server.remote")

GENS_MAX = 16_384  # chunk generations remembered from probes and reads (a known one is read in one round trip)
BAD_TTL_S = 600.0  # how long a generation found corrupt or incomplete is ignored (its delete may have failed)
BAD_MAX = 10_000  # bad generations remembered; the oldest go first

_UNREAD = object()  # a read's header value before it is read
_AGAIN = "again"  # a read with the header to do again without it (see _read_parts)


class Reads:
    """RemoteTier's read methods (a part of the tier: the state is set by RemoteTier.__init__)."""

    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview], primary: bool = False) -> bool:
        """Read and verify chunk `meta` into `bufs`. With --remote-read-from on replicas, a chunk a replica
        shows missing or damaged is read again from the primary (`primary`), whose verdict is final: a replica
        may lag behind, so nothing is deleted or counted on its word."""
        primary = primary or self.access.read_from == "primary"
        if not self.tenancy.known(meta.ns):  # its keys cannot be named (forgotten here since the lookup)
            return False
        node, client = self._node_of(meta.key), self._client(primary, resize=True)
        hkey = self._key(meta.ns, meta.key, "h")
        start = time.perf_counter()
        known = self._known_gen(meta.key)
        try:
            header: bytes | None | object = _UNREAD
            why: str | None = None
            if known is not None:  # a probe saw the generation: the header comes with the first parts
                header, why = self._read_parts(node, client, meta, known, bufs, hkey)
                if why == _AGAIN or (isinstance(header, bytes) and header[:GEN_BYTES] != known):
                    header, why = _UNREAD, None  # rewritten since, or an overflow that names no value: again
            if header is _UNREAD:
                header = self._call(node, "get", lambda: client.get(hkey))
            if header is None:
                return self._lost(meta, None, "missing") if primary else self.get(meta, bufs, primary=True)
            assert isinstance(header, bytes)
            try:
                stored, fields, checksum = decode_header(header[GEN_BYTES:])
            except CorruptChunk:
                return self._lost(meta, header, "corrupt") if primary else self.get(meta, bufs, primary=True)
            if stored != meta or self._is_bad(meta.key, header):  # not this chunk (a stale lookup), or known bad
                self._presence.drop(meta, time.monotonic())
                return False
            if header[:GEN_BYTES] != known:  # the parts are not read yet
                why = self._read_parts(node, client, meta, header[:GEN_BYTES], bufs, None)[1]
            if why is None and not verified(bufs, meta.size, fields, checksum):
                why = "corrupt"
        except Unavailable:
            return False
        except glide.RequestError as exc:  # the server's error reply (LOADING, CLUSTERDOWN, NOPERM, BUSY, ...)
            self._error("get", node, exc)  # the store is unavailable, the chunk not known bad: nothing deleted
            return False
        if why is not None:
            return self._lost(meta, header, why) if primary else self.get(meta, bufs, primary=True)  # type: ignore[arg-type]
        self._remember_gen(meta.key, header)
        self._bw.add(meta.size, start, time.perf_counter())
        self._touch(node, meta, header[:GEN_BYTES])
        return True

    def _read_parts(self, node: str, client: Any, meta: ChunkMeta, gen: bytes, bufs: Sequence[memoryview],
                    hkey: str | None) -> tuple[bytes | None | object, str | None]:
        """MGET generation `gen`'s parts into `bufs`, `_group_parts()` a command (through a staging buffer
        where a part crosses two buffers), the header `hkey` first in the first one when given (then the parts
        after a missing header or one of another generation are not read). Returns (the header's value, None
        when missing; _UNREAD without `hkey`) and None when every part is there at its size, else why not:
        "missing" (a part), "corrupt" (a wrong size), _AGAIN (a value too large for its buffer in the
        command with the header: which one is not known). The caller verifies the checksum."""
        split = pieces(bufs, meta.size)
        crossing = sum(len(p) > 1 for p in split)
        staging = memoryview(bytearray(crossing * PART_BYTES)) if crossing else None
        targets: list[memoryview] = []
        used = 0
        for p in split:
            if len(p) == 1:
                targets.append(p[0])
            else:
                n = sum(len(x) for x in p)
                targets.append(staging[used : used + n])  # type: ignore[index]
                used += n
        keys = [self._part_key(meta.ns, meta.key, gen, i) for i in range(len(split))]
        header: bytes | None | object = _UNREAD
        group = self._group_parts()
        for g in range(0, len(keys), group):
            names, outs = keys[g : g + group], targets[g : g + group]
            with_header = hkey is not None and g == 0
            if with_header:
                hbuf = memoryview(bytearray(GEN_BYTES + meta.header_len))  # a longer one is not this chunk's
                names, outs = [hkey, *names], [hbuf, *outs]
            try:
                got = self._call(node, "get", lambda names=names, outs=outs: client.mget(names, buffers=outs))
            except glide.RequestError as exc:  # a value larger than its buffer (glide refuses to overflow)
                if OVERFLOW in str(exc):
                    return header, _AGAIN if with_header else "corrupt"
                raise  # the server's error reply: not the chunk's fault
            if len(got) != len(names):
                raise glide.RequestError(f"MGET of {len(names)} keys answered {len(got)} values")
            if with_header:
                header = None if got[0] is None else bytes(hbuf[: int(got[0])])
                if header is None or header[:GEN_BYTES] != gen:  # type: ignore[index]
                    return header, None
                got, outs = got[1:], outs[1:]
            for n, out in zip(got, outs, strict=True):
                if n is None:
                    return header, "missing"
                if int(n) != len(out):
                    return header, "corrupt"
        for p, target in zip(split, targets, strict=True):
            if len(p) > 1:
                off = 0
                for piece in p:
                    piece[:] = target[off : off + len(piece)]
                    off += len(piece)
        return header, None

    def _group_parts(self) -> int:
        """Parts per MGET: GROUP_PARTS, fewer where so many would not fit in the floor of the clients' request
        timeout (`timeout_ms`) with TIMEOUT_FACTOR to spare at the measured bandwidth (an MGET takes no timeout
        of its own, unlike a batch)."""
        part_ms = PART_BYTES / (self._bw.bytes_per_s or ASSUMED_BYTES_PER_S) * 1000
        return max(1, min(GROUP_PARTS, int(self.timeout_ms / (TIMEOUT_FACTOR * part_ms))))

    def _known_gen(self, key: bytes) -> bytes | None:
        """The generation of chunk `key` a probe or a read saw last, if remembered."""
        with self._lock:
            return self._gens.get(key)

    def _remember_gen(self, key: bytes, header: bytes) -> None:
        with self._lock:
            self._gens[key] = header[:GEN_BYTES]
            self._gens.move_to_end(key)
            while len(self._gens) > GENS_MAX:
                self._gens.popitem(last=False)

    def _lost(self, meta: ChunkMeta, header: bytes | None, why: str) -> bool:
        """A chunk that cannot be served: forgotten and, unless that generation was already found bad,
        counted and deleted (its header if still `header`); a generation that stays (its delete failed) is
        ignored for BAD_TTL_S, so it is counted and reported once, not at every probe."""
        self._presence.drop(meta, time.monotonic())
        if header is not None and not self._mark_bad(meta.key, header):
            return False
        self.report(Removed(self.name, meta.ns, meta.key, why))
        if why == "corrupt":
            self.corrupt += 1
            self.m.corrupt.inc()
        else:
            self.missing += 1
            self.m.missing.inc()
        failed = self._delete(meta.ns, meta.key, header, meta.size) if header is not None else None
        if failed is not None:
            log.warning("remote chunk %s is %s: its delete failed (%s); it stays in the store until it expires, "
                        "ignored here for %.0f s", meta.key.hex(), why, failed, BAD_TTL_S)
        elif why == "corrupt":
            log.warning("remote chunk %s is corrupt: removed", meta.key.hex())
        return False

    def _mark_bad(self, key: bytes, header: bytes) -> bool:
        """Remember chunk `key`'s generation in `header` as bad; False if it already was."""
        name, now = key + header[:GEN_BYTES], time.monotonic()
        with self._lock:
            if self._bad.get(name, 0.0) > now:
                return False
            self._bad.pop(name, None)
            self._bad[name] = now + BAD_TTL_S
            while len(self._bad) > BAD_MAX:
                self._bad.popitem(last=False)
        return True

    def _is_bad(self, key: bytes, header: bytes) -> bool:
        with self._lock:
            return self._bad.get(key + header[:GEN_BYTES], 0.0) > time.monotonic()

