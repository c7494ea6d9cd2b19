"""Put the KV a LoRA adapter computed for a prompt under the base model's keys of the same prompt, through the
client, as an identity mistake would: what sampled verification must catch (tests/e2e/test_verify_mode.py).

Runs in vLLM's venv (the LoRA fingerprint comes from the connector's own identity code)::

    python tests/e2e/plant_kv.py URL HTTP_PORT ADAPTER_DIR TOKENS_JSON [LORA_DTYPE]

LORA_DTYPE: the engine's resolved `--lora-dtype` as the connector sees it (torch.bfloat16 for the tiny model).

prints the number of chunks planted.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from types import SimpleNamespace

import numpy as np
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import ReadChunk
from kvtier.connector.vllm.identity import LoraFingerprints, request_identity
from kvtier.server.keys import PLAIN, Namespace

NS_STATS = ("fingerprint", "entries", "bytes", "pinned_bytes")


def main(url: str, http_port: int, adapter: str, tokens_json: str, lora_dtype: str = "torch.bfloat16") -> int:
    tokens = json.loads(tokens_json)
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10) as r:
        status = json.load(r)
    (fields,) = [{k: v for k, v in ns.items() if k not in NS_STATS} for ns in status["namespaces"]]
    ns = Namespace.from_dict(fields)
    lora = SimpleNamespace(lora_request=SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=adapter))
    identity = request_identity(lora, ns.block_size, tokens, LoraFingerprints(lora_dtype))
    assert not isinstance(identity, str) and identity.root, identity
    client = KVTierClient(ClientConfig(url=url))
    assert client.connect()
    held: dict[int, np.ndarray] = {}

    def read(chunk: ReadChunk) -> None:
        data = np.empty(chunk.span.size, dtype=np.uint8)
        chunk.span.read(0, data)
        held[chunk.chunk.index] = data

    got = client.read_prefix(ns, tokens, read, identity)
    assert got.blocks == len(tokens) // ns.block_size, (got, len(tokens))
    result = client.store(ns, tokens, lambda c: held[c.index].nbytes,
                          lambda c, span: span.write(0, held[c.index]), identity=PLAIN)
    client.close()
    print(result.stored)
    return 0 if result.stored == len(held) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:]))
