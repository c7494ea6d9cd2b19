"""Shared by the L1 tests (test_l1_store.py, test_l1_holds.py): a small namespace, chunk families of
predictable keys, a fake clock, and an L1Store with its Holds over a tiny page pool."""

from __future__ import annotations

from kvtier.server import protocol as p
from kvtier.server.eviction import make_policy
from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.keys import Namespace, digest
from kvtier.server.l1.holdings import ClientState
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
BPC = NS.blocks_per_chunk  # 4
PAGE = 1024
MIN_BLOCK_BYTES = 256  # a test page stands for a 64 KiB one: at most 4 blocks per page
FAMILIES = 10


def block_key(family: int, j: int) -> bytes:
    """Key of the first j blocks of chunk family `family` (the j = BPC case is the chunk's own key)."""
    return digest(b"fam%d/%d" % (family, j))


def item(family: int, blocks: int, size: int) -> p.StoreItem:
    return p.StoreItem(block_key(family, blocks), size, blocks,
                       tuple(block_key(family, j) for j in range(1, blocks)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_l1(num_pages: int = 32, policy: str | EvictionPolicy = "lru") -> tuple[L1Store, Holds, bytes]:
    """An L1Store and its Holds (fake clock, no lock files), with NS registered."""
    metrics = Metrics()
    store = L1Store(PagePool(num_pages, PAGE), make_policy(policy) if isinstance(policy, str) else policy, metrics,
                    min_block_bytes=MIN_BLOCK_BYTES)
    holds = Holds(store, metrics, clock=FakeClock())
    return store, holds, holds.register(NS)


def hello(holds: Holds, name: bytes) -> ClientState:
    holds.hello(name, name.decode(), 1)
    return holds.client(name)


class RefuseAll(type(make_policy("lru"))):  # type: ignore[misc]
    """LRU that refuses every offer to a full cache: the admission hook on its own."""

    name = "refuse-all"

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[bytes] = []

    def touch(self, key: bytes) -> None:
        self.touched.append(key)
        super().touch(key)

    def admit(self, key, size, evictable):  # type: ignore[no-untyped-def]
        return False


def full_l1(policy: EvictionPolicy) -> tuple[L1Store, Holds, bytes, ClientState]:
    """A 2-page L1 holding families 1 (older) and 2, one page each; and the client that stored them."""
    store, holds, fp = make_l1(num_pages=2, policy=policy)
    a = hello(holds, b"a")
    for family in (1, 2):
        [r] = holds.reserve(a, fp, [item(family, BPC, PAGE)])
        holds.commit(a, [r[1]])
    return store, holds, fp, a
