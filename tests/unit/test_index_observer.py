"""server/index.py: the observer hears of each key exactly as it enters and leaves the index (the presence
filter's accounting: shm/presence.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.server.index import PrefixIndex

pytestmark = pytest.mark.unit


class Tally:
    def __init__(self) -> None:
        self.count: Counter[bytes] = Counter()
        self.clears = 0

    def add(self, key: bytes) -> None:
        assert self.count[key] == 0, "a key entered twice"
        self.count[key] += 1

    def discard(self, key: bytes) -> None:
        assert self.count[key] == 1, "a key left that was not there"
        del self.count[key]

    def clear(self) -> None:
        self.count.clear()
        self.clears += 1

    @property
    def present(self) -> set[bytes]:
        return set(self.count)


class Holder:
    def __init__(self, key: bytes, aliases: tuple[bytes, ...]) -> None:
        self.key, self.aliases = key, aliases


def test_shadowed_alias_stays_until_its_last_holder_goes() -> None:
    tally = Tally()
    index: PrefixIndex[Holder] = PrefixIndex(tally)
    a = Holder(b"A", (b"x", b"y"))
    b = Holder(b"B", (b"x", b"z"))  # shares the leading block x with a
    index.add(a, a.key, 3, a.aliases)
    index.add(b, b.key, 3, b.aliases)
    assert tally.present == {b"A", b"x", b"y", b"B", b"z"}
    index.remove(a, a.key, a.aliases)
    assert tally.present == {b"x", b"B", b"z"} == set(index._map)  # x falls back to b: never left
    index.remove(b, b.key, b.aliases)
    assert tally.present == set() == set(index._map)


def test_overwrite_is_not_a_second_entry() -> None:
    tally = Tally()
    index: PrefixIndex[Holder] = PrefixIndex(tally)
    a, a2 = Holder(b"A", ()), Holder(b"A", ())
    index.add(a, b"A", 1, ())
    index.add(a2, b"A", 1, ())  # the key is indexed already: it does not enter again
    index.remove(a, b"A", ())  # not the holder the index points to: the key stays
    assert tally.present == {b"A"}
    index.remove(a2, b"A", ())
    assert tally.present == set()


def test_clear_and_observe_later() -> None:
    index: PrefixIndex[Holder] = PrefixIndex()
    index.add(Holder(b"A", (b"x",)), b"A", 2, (b"x",))
    tally = Tally()
    index.observe(tally)  # told of what is indexed already
    assert tally.present == {b"A", b"x"}
    index.clear()
    assert tally.present == set() and tally.clears == 2


KEYS = [bytes([i]) for i in range(6)]
ops = st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.sampled_from(KEYS),
                         st.lists(st.sampled_from(KEYS), max_size=3)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_observer_matches_the_index(steps) -> None:
    """After any sequence of adds and removes, the keys the observer counts present are exactly the index's."""
    tally = Tally()
    index: PrefixIndex[Holder] = PrefixIndex(tally)
    holders: dict[int, Holder] = {}
    for adding, slot, key, aliases in steps:
        held = holders.get(slot)
        if adding and held is None:
            holders[slot] = h = Holder(key, tuple(aliases))
            index.add(h, h.key, len(h.aliases) + 1, h.aliases)
        elif not adding and held is not None:
            index.remove(held, held.key, held.aliases)
            del holders[slot]
        assert tally.present == set(index._map)
    for h in holders.values():
        index.remove(h, h.key, h.aliases)
    assert tally.present == set(index._map)
