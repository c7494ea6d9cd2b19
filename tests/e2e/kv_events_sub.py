"""Subscribe to a vLLM engine's KV events (`--kv-events-config` publisher zmq) and write each event, decoded
with vLLM's own msgspec structs (`KVEventBatch`), as a JSON line: run with the vLLM venv's python.

    python kv_events_sub.py tcp://127.0.0.1:5557 events.jsonl

Block hashes are written as vLLM publishes them (64-bit integers by default; bytes as hex).
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch


def plain(value: object) -> object:
    return value.hex() if isinstance(value, bytes) else value


def main(endpoint: str, out_path: str) -> None:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sub = zmq.Context().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    with open(out_path, "a", buffering=1) as out:
        while True:
            _topic, seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            for event in batch.events:
                fields = {f: getattr(event, f) for f in event.__struct_fields__}
                fields["block_hashes"] = [plain(h) for h in fields.get("block_hashes") or ()]
                if "parent_block_hash" in fields:
                    fields["parent_block_hash"] = plain(fields["parent_block_hash"])
                fields.pop("extra_keys", None)
                out.write(json.dumps({"seq": int.from_bytes(seq, "big"), "type": type(event).__name__, **fields})
                          + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
