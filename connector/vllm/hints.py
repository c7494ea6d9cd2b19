"""Request hints (docs/hints.md): what one request asks of kvtier in its `kv_transfer_params`, e.g.

    {"kvtier": {"store": false, "max_store_tokens": 512, "retain_s": 600, "priority": "high",
                "session": {"id": "abc", "end": true}}}

(the OpenAI API's `kv_transfer_params` extra body reaches vLLM's scheduler as `request.kv_transfer_params`).
A hint is advice: a bad field (wrong type, negative, unknown priority, over-long session id, unknown key) is
ignored and counted by reason (protocol.HINT_IGNORED_REASONS), never a failed request. Nothing is capped here:
the server bounds `retain_s` and the number of live sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtier.server import protocol as p

KEY = "kvtier"  # the connector's own map in kv_transfer_params (other connectors use other keys)
FIELDS = ("store", "max_store_tokens", "retain_s", "priority", "session")
SESSION_FIELDS = ("id", "end")


@dataclass(frozen=True)
class RequestHints:
    """One request's hints as parsed: what the connector stores, the `Hint` its stores carry, whether the
    request is its session's last turn, and why fields were ignored (one reason per ignored field)."""

    store: bool = True
    max_store_tokens: int | None = None
    hint: p.Hint = p.NO_HINT
    session_end: bool = False
    ignored: tuple[str, ...] = ()

    def stored_blocks(self, prompt_tokens: int, block_size: int) -> int:
        """How many whole prompt blocks of a `prompt_tokens`-token prompt may be stored: none with `store:
        false`, those within the first `max_store_tokens` tokens, else all of them."""
        if not self.store:
            return 0
        limit = prompt_tokens if self.max_store_tokens is None else min(prompt_tokens, self.max_store_tokens)
        return limit // block_size

    @property
    def ends_session(self) -> str:
        """The session this request ends ("" when none)."""
        return self.hint.session if self.session_end else ""


NO_HINTS = RequestHints()


def parse_hints(params: Any) -> RequestHints:
    """A request's hints from its `kv_transfer_params` (a map, or None). No `kvtier` map: no hints and nothing
    ignored (the parameters may be another connector's)."""
    if not isinstance(params, dict) or KEY not in params:
        return NO_HINTS
    given = params[KEY]
    if not isinstance(given, dict):
        return RequestHints(ignored=("not_a_map",))
    ignored: list[str] = ["unknown_key" for name in given if name not in FIELDS]
    store = _checked(given, "store", lambda v: isinstance(v, bool), True, ignored)
    max_store = _checked(given, "max_store_tokens", _count, None, ignored)
    retain = _checked(given, "retain_s", _seconds, 0.0, ignored)
    priority = _checked(given, "priority", lambda v: v in p.PRIORITIES, "normal", ignored)
    session, end = _session(given.get("session"), ignored)
    hint = p.Hint(float(retain), p.PRIORITIES.index(priority), session)
    return RequestHints(store, max_store, hint, end, tuple(ignored))


def _checked(given: dict[str, Any], name: str, valid: Any, default: Any, ignored: list[str]) -> Any:
    """`given[name]` when present and valid; else `default` (an invalid value is counted under `name`)."""
    if name not in given:
        return default
    value = given[name]
    if not valid(value):
        ignored.append(name)
        return default
    return value


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _session(value: Any, ignored: list[str]) -> tuple[str, bool]:
    """(session id, ends it) from `{"id": str, "end": bool}`; ("", False) when absent or ignored."""
    if value is None:
        return "", False
    if not isinstance(value, dict):
        ignored.append("session")
        return "", False
    ignored.extend("unknown_key" for name in value if name not in SESSION_FIELDS)
    sid, end = value.get("id"), value.get("end", False)
    if not isinstance(sid, str) or not 0 < len(sid) <= p.MAX_SESSION_ID or not isinstance(end, bool):
        ignored.append("session")
        return "", False
    return sid, end
