"""How the remote tier reads an alias key's value (server/tiers/remote/layout.py `holders`): holder records appended
one after another, the newest last; a value of an earlier kvtier (one record) and bytes that are not
kvtier's."""

from __future__ import annotations

import os

import pytest
from kvtier.server.tiers.remote.layout import ALIAS, ALIAS_HOLDERS, holders

pytestmark = pytest.mark.unit


def record(lead: int = 1) -> bytes:
    return ALIAS.pack(os.urandom(16), lead)


def test_holders_come_newest_first_each_once():
    a, b, c = record(), record(), record(2)
    assert holders(a + b + a + c) == [c, a, b]


def test_an_earlier_kvtier_s_value_is_its_one_holder():
    one = record(3)
    assert holders(one) == [one]


def test_at_most_the_newest_holders_are_read():
    records = [record() for _ in range(3 * ALIAS_HOLDERS)]
    assert holders(b"".join(records)) == records[::-1][:ALIAS_HOLDERS]


@pytest.mark.parametrize("junk", [b"", b"x", b"not kvtier's", os.urandom(ALIAS.size - 1)])
def test_bytes_before_the_first_whole_record_are_ignored(junk):
    assert holders(junk) == []
    newest = record()
    assert holders(junk + newest) == [newest]
