"""The vLLM scheduler's lookup names every tensor-parallel rank: the namespaces it sends as `ranks` are exactly
the ones the workers of ranks 1.. compute for themselves (and so store under), for every salt, so the server
can answer the prefix every rank holds (tests/integration/test_tp_lookup.py tests that answer).

Needs torch and vLLM: the dev venv skips it; tests/e2e/test_torch_unit_tests.py runs it in vLLM's venv.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.results import LookupResult  # noqa: E402
from kvtier.connector.vllm.meta import ConnectorOptions, ConnectorSide  # noqa: E402
from kvtier.connector.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.server.keys import ChunkKeys, Namespace  # noqa: E402
from vllm_fakes import FakeModel

pytestmark = pytest.mark.unit

BS = 16
OPTIONS = ConnectorOptions(url="tcp://127.0.0.1:9", chunk_size=64, model_id="tp-test-model")


def vllm_config(tp: int) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=FakeModel("tp-test-model"), parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, world_size=tp),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto", kv_cache_layout=None),
        device_config=SimpleNamespace(device_type="cpu"), lora_config=None)


class Recorder:
    """The scheduler's client: records what each lookup names, answers a miss."""

    def __init__(self) -> None:
        self.lookups: list[tuple[Namespace, list[Namespace]]] = []

    def may_hold(self, key: bytes) -> bool:
        return True  # no presence filter: every lookup goes to the server

    def lookup_chunks(self, ns: Namespace, chunks: list[ChunkKeys], lease: bool = False,
                      ranks: Sequence[tuple[Namespace, list[ChunkKeys]]] = (), again: bool = False) -> LookupResult:
        self.lookups.append((ns, [other for other, _ in ranks]))
        return LookupResult([], [], [], BS)


def request(req_id: str, salt: str | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(10 * BS)), cache_salt=salt,
                           lora_request=None, mm_features=None, prompt_embeds=None)


@pytest.mark.parametrize("tp", [1, 4])
def test_the_lookup_names_every_workers_namespace(tp: int) -> None:
    side = SchedulerSide(vllm_config(tp), OPTIONS, None)
    recorder = side.client = Recorder()  # type: ignore[assignment]
    for i, salt in enumerate([None, "tenant-a"]):
        assert side.get_num_new_matched_tokens(request(f"r{i}", salt), 0) == (0, False)
    workers = [ConnectorSide(vllm_config(tp), OPTIONS, tp_rank=rank, kv_cache_config=None) for rank in range(tp)]
    for (ns, ranks), salt in zip(recorder.lookups, ["", "tenant-a"], strict=True):
        assert ns == workers[0].namespace(salt)
        assert ranks == [worker.namespace(salt) for worker in workers[1:]]
    assert len({n.fingerprint() for ns, ranks in recorder.lookups for n in (ns, *ranks)}) == 2 * tp  # all differ
