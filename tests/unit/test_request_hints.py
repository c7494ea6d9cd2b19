"""Request hints on the connector side (connector/vllm/hints.py, scheduler.py, meta.py): a request's
`kv_transfer_params` parsed into what is stored and the `Hint` its stores carry, bad fields ignored and counted
(never a failed request), and the scheduler's decisions: no store for `store: false`, only the first
`max_store_tokens`, the hint on the SaveSpec, one `end_session` for a session's last turn. Also the
`kvtier.tenant` option (another name for `kvtier.cache_salt`).

Its package imports torch and vLLM: the dev venv skips it; tests/e2e/test_torch_unit_tests.py runs it in vLLM's
venv.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.results import LookupResult  # noqa: E402
from kvtier.connector.tally import Tally  # noqa: E402
from kvtier.connector.vllm.hints import NO_HINTS, RequestHints, parse_hints  # noqa: E402
from kvtier.connector.vllm.meta import ConnectorOptions, KVTierMetadata, KVTierWorkerMetadata  # noqa: E402
from kvtier.connector.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.server import protocol as p  # noqa: E402
from kvtier.server.keys import ChunkKeys, Namespace  # noqa: E402
from vllm_fakes import FakeModel

pytestmark = pytest.mark.unit

BS = 16
PROMPT = list(range(100, 100 + 10 * BS))  # ten whole blocks


# -- the parser -----------------------------------------------------------------------------------


def test_no_kvtier_map_means_no_hints_and_nothing_ignored():
    for params in (None, {}, {"do_remote_prefill": True}, "text", 7):
        assert parse_hints(params) == NO_HINTS
    assert NO_HINTS.store and NO_HINTS.max_store_tokens is None and NO_HINTS.hint == p.NO_HINT


def test_every_hint_is_parsed():
    hints = parse_hints({"kvtier": {"store": False, "max_store_tokens": 512, "retain_s": 600, "priority": "high",
                                    "session": {"id": "abc", "end": True}}})
    assert hints == RequestHints(False, 512, p.Hint(600.0, p.PRIORITIES.index("high"), "abc"), True, ())
    assert hints.ends_session == "abc"
    assert hints.hint.to_wire() == {"retain_s": 600.0, "priority": "high", "session": "abc"}
    live = parse_hints({"kvtier": {"session": {"id": "abc"}, "retain_s": 1.5, "priority": "low"}})
    assert live.hint == p.Hint(1.5, 0, "abc") and not live.session_end and live.ends_session == ""
    assert live.store and live.max_store_tokens is None


@pytest.mark.parametrize(("given", "reasons"), [
    ("nope", ["not_a_map"]),
    ({"store": "false"}, ["store"]),
    ({"store": 0}, ["store"]),
    ({"max_store_tokens": -1}, ["max_store_tokens"]),
    ({"max_store_tokens": 12.5}, ["max_store_tokens"]),
    ({"max_store_tokens": True}, ["max_store_tokens"]),
    ({"retain_s": -5}, ["retain_s"]),
    ({"retain_s": "600"}, ["retain_s"]),
    ({"retain_s": float("inf")}, ["retain_s"]),
    ({"retain_s": float("nan")}, ["retain_s"]),
    ({"priority": "urgent"}, ["priority"]),
    ({"priority": 2}, ["priority"]),
    ({"session": "abc"}, ["session"]),
    ({"session": {"id": "x" * (p.MAX_SESSION_ID + 1)}}, ["session"]),
    ({"session": {"id": ""}}, ["session"]),
    ({"session": {"end": True}}, ["session"]),
    ({"session": {"id": "abc", "end": "yes"}}, ["session"]),
    ({"session": {"id": "abc", "ttl": 5}}, ["unknown_key"]),
    ({"stor": False}, ["unknown_key"]),
    ({"retain_s": -1, "priority": "top", "colour": 1}, ["unknown_key", "retain_s", "priority"]),
])
def test_a_bad_field_is_ignored_and_counted_by_reason(given: Any, reasons: list[str]):
    hints = parse_hints({"kvtier": given})
    assert sorted(hints.ignored) == sorted(reasons)
    assert set(hints.ignored) <= set(p.HINT_IGNORED_REASONS)
    # what was ignored takes its default; the rest of the map still counts
    assert hints.store is (given.get("store") is not False if isinstance(given, dict) else True)


def test_good_fields_beside_a_bad_one_are_kept():
    hints = parse_hints({"kvtier": {"store": "no", "retain_s": 30, "session": {"id": "s1", "end": True}}})
    assert hints.ignored == ("store",) and hints.store
    assert hints.hint == p.Hint(30.0, 1, "s1") and hints.session_end
    longest = parse_hints({"kvtier": {"session": {"id": "x" * p.MAX_SESSION_ID}}})
    assert longest.hint.session == "x" * p.MAX_SESSION_ID and not longest.ignored


@pytest.mark.parametrize(("hints", "blocks"), [
    (NO_HINTS, 10), (RequestHints(store=False), 0), (RequestHints(max_store_tokens=40), 2),
    (RequestHints(max_store_tokens=48), 3), (RequestHints(max_store_tokens=15), 0),
    (RequestHints(max_store_tokens=10_000), 10), (RequestHints(max_store_tokens=0), 0),
])
def test_stored_blocks_are_the_whole_blocks_the_hints_allow(hints: RequestHints, blocks: int):
    assert hints.stored_blocks(len(PROMPT), BS) == blocks
    assert hints.stored_blocks(len(PROMPT) + 7, BS) == blocks  # a partial last block is never stored


# -- the kvtier.tenant option ---------------------------------------------------------------------


def test_tenant_is_another_name_for_cache_salt():
    assert ConnectorOptions.from_extra({"kvtier.tenant": "team-a"}).cache_salt == "team-a"
    assert ConnectorOptions.from_extra({"kvtier.cache_salt": "team-a"}).tenant == "team-a"
    both = ConnectorOptions.from_extra({"kvtier.tenant": "team-a", "kvtier.cache_salt": "team-a"})
    assert both.cache_salt == both.tenant == "team-a"
    with pytest.raises(ValueError, match=r"kvtier\.tenant.*kvtier\.cache_salt"):
        ConnectorOptions.from_extra({"kvtier.tenant": "team-a", "kvtier.cache_salt": "team-b"})


# -- the scheduler's decisions --------------------------------------------------------------------


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        model_config=FakeModel("hints-test-model"), parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                                           world_size=1),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto", kv_cache_layout=None),
        device_config=SimpleNamespace(device_type="cpu"), lora_config=None)


class Server:
    """The scheduler's client: answers every lookup with a miss; records lookups and ended sessions. Its
    presence filter holds `present` (None: no filter, every key may be held)."""

    def __init__(self) -> None:
        self.lookups = 0
        self.ended: list[str] = []
        self.reports: list[dict] = []
        self.present: set[bytes] | None = None

    def may_hold(self, key: bytes) -> bool:
        return self.present is None or key in self.present

    def lookup_chunks(self, ns: Namespace, chunks: list[ChunkKeys], lease: bool = False,
                      ranks: Sequence[tuple[Namespace, list[ChunkKeys]]] = (), again: bool = False) -> LookupResult:
        self.lookups += 1
        return LookupResult([], [], [], BS)

    def end_session(self, session: str) -> bool:
        self.ended.append(session)
        return True

    def release(self, leases: Sequence[int], wait: bool = True) -> int:
        return 0

    def report(self, counts: dict, ns: Namespace | None = None) -> bool:
        self.reports.append(counts)
        return True


def scheduler(async_transfers: bool = False, async_stores: bool = True) -> tuple[SchedulerSide, Server]:
    side = SchedulerSide(vllm_config(), ConnectorOptions(url="tcp://127.0.0.1:9", chunk_size=4 * BS,
                                                         model_id="hints-test-model", async_transfers=async_transfers,
                                                         async_stores=async_stores), None)
    server = Server()
    side.tally.close()
    side.client = server  # type: ignore[assignment]
    side.tally = Tally(server.report, every_s=3600)
    return side, server


def request(req_id: str, params: Any) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(PROMPT), cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None, kv_transfer_params=params)


def step(side: SchedulerSide, req: SimpleNamespace, local: int = 0) -> KVTierMetadata:
    """Look `req` up (vLLM's own prefix cache holding its first `local` tokens), then schedule the rest of its
    prompt in one step (as vLLM does for a short prompt)."""
    assert side.get_num_new_matched_tokens(req, local) == (0, False)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                          block_ids=(list(range(500, 511)),), num_computed_tokens=local)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    output = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={req.request_id: len(PROMPT) - local},
                             scheduled_new_reqs=[new], scheduled_cached_reqs=cached)
    return side.build_connector_meta(output)  # type: ignore[arg-type]


def test_a_request_without_hints_stores_its_whole_prompt_with_no_hint():
    side, server = scheduler()
    meta = step(side, request("r", None))
    [save] = meta.saves
    assert save.token_ids == PROMPT and save.block_ids == list(range(500, 510)) and save.hint == p.NO_HINT
    assert side.request_finished(request("r", None), [])[0] is True  # stores are asynchronous: blocks held
    assert server.ended == []


def test_synchronous_stores_hold_no_blocks():
    side, _ = scheduler(async_stores=False)
    assert len(step(side, request("r", None)).saves) == 1
    assert side.request_finished(request("r", None), [])[0] is False  # stored in the step: nothing to hold


def test_a_request_whose_store_every_worker_finished_is_not_held():
    side, _ = scheduler()
    side._workers = 2  # two workers (TP 2): both must report the store done
    assert len(step(side, request("r", None)).saves) == 1
    one = SimpleNamespace(kv_connector_worker_meta=KVTierWorkerMetadata({"r": 1}), finished_recving=None,
                          invalid_block_ids=set())
    side.update_connector_output(one)  # type: ignore[arg-type]
    assert side._requests["r"].stored_by == 1
    side.update_connector_output(one)  # type: ignore[arg-type]
    assert side.request_finished(request("r", None), [])[0] is False  # nothing in flight: freed at once
    side.update_connector_output(one)  # type: ignore[arg-type]  # a late report of a finished request: ignored
    assert KVTierWorkerMetadata({"a": 1}).aggregate(KVTierWorkerMetadata({"a": 1, "b": 1})).stored == {"a": 2, "b": 1}


def test_store_false_is_looked_up_but_never_stored_nor_held():
    side, server = scheduler(async_transfers=True)
    req = request("r", {"kvtier": {"store": False}})
    meta = step(side, req)
    assert server.lookups == 1 and meta.saves == []
    assert side.request_finished(req, [])[0] is False  # no store in flight: the blocks are not held
    plain = request("q", None)
    assert len(step(side, plain).saves) == 1
    assert side.request_finished(plain, [])[0] is True  # an asynchronous store holds its blocks


def test_max_store_tokens_stores_only_the_whole_blocks_within_it():
    side, _ = scheduler()
    [save] = step(side, request("r", {"kvtier": {"max_store_tokens": 3 * BS + 5}})).saves
    assert save.token_ids == PROMPT[: 3 * BS] and save.block_ids == [500, 501, 502]
    assert step(side, request("q", {"kvtier": {"max_store_tokens": BS - 1}})).saves == []


def test_the_save_carries_the_hint_and_the_last_turn_ends_its_session_once():
    side, server = scheduler()
    turn = request("t1", {"kvtier": {"retain_s": 600, "priority": "high", "session": {"id": "abc"}}})
    [save] = step(side, turn).saves
    assert save.hint == p.Hint(600.0, 2, "abc")
    side.request_finished(turn, [])
    assert server.ended == []  # a turn that does not end its session leaves it live
    last = request("t2", {"kvtier": {"session": {"id": "abc", "end": True}}})
    [save] = step(side, last).saves
    assert save.hint == p.Hint(0.0, 1, "abc")
    side.request_finished(last, [])
    side.request_finished(last, [])  # vLLM reports a request finished once; a repeat is not tracked
    assert server.ended == ["abc"]


def test_a_session_ends_even_when_its_last_turn_stores_nothing():
    side, server = scheduler()
    last = request("t", {"kvtier": {"store": False, "session": {"id": "s9", "end": True}}})
    assert step(side, last).saves == []
    side.request_finished(last, [])
    assert server.ended == ["s9"]


def test_ignored_hints_are_counted_and_the_request_goes_on():
    side, server = scheduler()
    req = request("r", {"kvtier": {"retain_s": -1, "priority": "urgent", "bogus": 1, "max_store_tokens": 2 * BS}})
    [save] = step(side, req).saves
    assert save.token_ids == PROMPT[: 2 * BS] and save.hint == p.NO_HINT
    step(side, request("q", {"kvtier": "store nothing"}))
    side.tally.flush()
    totals: dict[str, int] = {}
    for counts in server.reports:
        for reason, n in counts.get("hints_ignored", {}).items():
            totals[reason] = totals.get(reason, 0) + n
    assert totals == {"retain_s": 1, "priority": 1, "unknown_key": 1, "not_a_map": 1}


def test_a_hinted_request_offers_the_chunks_it_did_not_compute_so_its_hint_applies_to_them():
    side, _ = scheduler()
    [plain] = step(side, request("r", None), local=4 * BS).saves
    assert plain.skip_chunks == 1  # vLLM's own cache held the first chunk: not offered again
    [hinted] = step(side, request("q", {"kvtier": {"retain_s": 60}}), local=4 * BS).saves
    assert hinted.skip_chunks == 0 and hinted.hint == p.Hint(60.0, 1, "")
    [hinted] = step(side, request("s", {"kvtier": {"store": True}}), local=4 * BS).saves
    assert hinted.skip_chunks == 1  # store: true asks nothing of the chunks
