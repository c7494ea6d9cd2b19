"""The one token comparison both ports use: UTF-8 bytes of the configured token against the bytes a client
sent (the ZeroMQ hello's `token` string encoded as UTF-8; the raw `Authorization: Bearer` header value,
which HTTP clients send as the token's UTF-8 bytes). Constant-time, so a wrong guess reveals nothing."""

from __future__ import annotations

import hmac


def token_matches(sent: bytes, token: bytes) -> bool:
    return hmac.compare_digest(sent, token)
