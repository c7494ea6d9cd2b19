"""Chunks kept by request hints (docs/hints.md): `retain_s` keeps a request's stored chunks for a while, a live
`session` keeps them until the session ends (its last turn, or an idle limit).

A kept chunk is out of the eviction order and not evictable (`L1Store.keep`); it still counts against its
tenant's quota, so hints never make room a tenant does not have: a store only kept chunks could make room for is
refused (`retained`). Bounded (HintBounds): retention is capped, and so are live sessions (a store
naming one more is stored but not kept, counted), and the ids of recently ended sessions are remembered so that
a late store of an ended session is not kept. Hints are not kept over a restart.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.server import protocol as p
from kvtier.server.l1.entry import Entry

ENDED_REMEMBERED = 4096


@dataclass(frozen=True)
class HintBounds:
    """The server's bounds on hints (--hint-max-retain-s, --hint-max-sessions, --hint-session-idle-s)."""

    max_retain_s: float = 3600.0
    max_sessions: int = 4096
    session_idle_s: float = 600.0


DEFAULT_BOUNDS = HintBounds()


@dataclass
class Session:
    last: float
    entries: dict[bytes, Entry] = field(default_factory=dict)


class Retention:
    def __init__(self, keep: Callable[[Entry, bool], None], is_stored: Callable[[Entry], bool],
                 clock: Callable[[], float], bounds: HintBounds = DEFAULT_BOUNDS,
                 refused: Callable[[], None] = lambda: None) -> None:
        self._keep = keep
        self._is_stored = is_stored
        self._clock = clock
        self.bounds = bounds
        self.sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._timed: list[tuple[float, int, Entry]] = []  # (until, tie-break, entry)
        self.refused_sessions = 0  # stores naming a session beyond max_sessions
        self._refused = refused

    def apply(self, entry: Entry, hint: p.Hint) -> None:
        """Keep a stored (or re-offered) chunk as its request's hint asks."""
        now = self._clock()
        keep = False
        if hint.retain_s > 0 and self.bounds.max_retain_s > 0:
            until = now + min(hint.retain_s, self.bounds.max_retain_s)
            if until > entry.until:
                entry.until = until
                heapq.heappush(self._timed, (until, id(entry), entry))
            keep = True
        if hint.session and hint.session not in self._ended:
            session = self.sessions.get(hint.session)
            if session is None and len(self.sessions) < self.bounds.max_sessions:
                session = self.sessions[hint.session] = Session(now)
            if session is None:
                self.refused_sessions += 1
                self._refused()
            else:
                session.last = now
                if entry.session and entry.session != hint.session:  # another session keeps it now
                    self.sessions.get(entry.session, Session(now)).entries.pop(entry.key, None)
                session.entries[entry.key] = entry
                entry.session = hint.session
                keep = True
        if keep and not entry.kept:
            self._keep(entry, True)

    def end(self, session_id: str) -> bool:
        """End a session: its chunks go back to the eviction order (unless still retained). False if it was not
        live."""
        session = self.sessions.pop(session_id, None)
        self._ended[session_id] = None
        self._ended.move_to_end(session_id)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if session is None:
            return False
        for entry in session.entries.values():
            if entry.session == session_id:
                entry.session = ""
                self._release(entry, self._clock())
        return True

    def sweep(self) -> None:
        """End retention that is over and sessions idle past `idle_s`."""
        now = self._clock()
        timed = self._timed
        while timed and timed[0][0] <= now:
            until, _, entry = heapq.heappop(timed)
            if entry.until == until:
                self._release(entry, now)
        for session_id in [s for s, session in self.sessions.items() if now - session.last > self.bounds.session_idle_s]:
            self.end(session_id)

    def _release(self, entry: Entry, now: float) -> None:
        if entry.kept and not entry.session and entry.until <= now and self._is_stored(entry):
            self._keep(entry, False)

