"""/reconfigure shrinks L1 under load (a client process storing and retrieving) without losing a pinned or
leased chunk and without a client error."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_admin_api import NS, PAGE, Server, doc, metric, pattern, store

pytestmark = pytest.mark.integration

LOAD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from kvtier.connector.client import ClientConfig, KVTierClient
    from kvtier.server.keys import Namespace
    ns = Namespace(model="admin-test", dtype="float16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
                   layout="test", chunk_size=64)
    size = 65536
    def pattern(key):
        return np.frombuffer((key * (size // 16 + 1))[:size], dtype=np.uint8)
    c = KVTierClient(ClientConfig(url=sys.argv[1], strict=True))
    c.connect()
    stats = {"stores": 0, "stored": 0, "refused": 0, "retrieves": 0, "read_tokens": 0, "mismatches": 0, "errors": []}
    def check(rc):
        buf = np.empty(size, dtype=np.uint8)
        rc.span.read(0, buf)
        if not np.array_equal(buf, pattern(rc.chunk.key)):
            stats["mismatches"] += 1
    rng = np.random.default_rng(0)
    docs = [[int(t) for t in np.random.default_rng(5000 + i).integers(0, 50000, 256)] for i in range(300)]
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        d = docs[int(rng.integers(0, len(docs)))]
        try:
            r = c.store(ns, d, lambda ck: size, lambda ck, span: span.write(0, pattern(ck.key)))
            stats["stores"] += 1; stats["stored"] += r.stored; stats["refused"] += sum(r.refused.values())
            d = docs[int(rng.integers(0, len(docs)))]
            stats["read_tokens"] += c.retrieve(ns, d, check); stats["retrieves"] += 1
        except Exception as exc:
            stats["errors"].append(repr(exc))
    c.close()
    print(json.dumps(stats))
""")


def test_shrink_under_load_keeps_pinned_and_leased_chunks(tmp_path):
    s = Server(tmp_path, l1_gb=1 / 16)  # 64 MiB = 1024 one-page chunks; the load's working set is 1200
    try:
        c = s.client()
        pinned, leased = doc(1, 256), doc(2, 256)
        store(c, pinned)
        store(c, leased)
        fp = NS.fingerprint().hex()
        assert s.http.post("/cache/pin", json={"namespace": fp, "token_ids": pinned}).json()["entries"] == 4
        # Held by a pin until the lease is taken; then only the lease keeps it (see read_while_shrinking).
        assert s.http.post("/cache/pin", json={"namespace": fp, "token_ids": leased}).json()["entries"] == 4
        load = subprocess.Popen([sys.executable, "-c", LOAD, s.zmq_url, "6"], stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)  # the load fills L1
        results = []

        def read_while_shrinking(rc) -> None:
            # The chunk is leased while this runs: shrink (twice, with a refused attempt between) meanwhile.
            if not results:
                assert s.http.post("/cache/unpin", json={"namespace": fp, "token_ids": leased}).status_code == 200
                r1 = s.http.post("/reconfigure", json={"l1_size_bytes": 4 * PAGE})  # below pinned + leased
                r2 = s.http.post("/reconfigure", json={"l1_size_bytes": 256 * PAGE})
                r3 = s.http.post("/reconfigure", json={"l1_size_bytes": 32 * PAGE})
                results.extend([r1, r2, r3])
                time.sleep(0.5)  # the load keeps running against the small cache while we hold the lease
            buf = np.empty(rc.span.size, dtype=np.uint8)
            rc.span.read(0, buf)
            assert np.array_equal(buf, pattern(rc.chunk.key)), "leased chunk changed under a shrink"

        assert c.retrieve(NS, leased, read_while_shrinking) == 256
        r1, r2, r3 = results
        assert r1.status_code == 409, r1.text
        assert r2.status_code == 200 and r2.json()["l1"]["evicted_entries"] > 0, r2.text
        assert r3.status_code == 200, r3.text
        out, _ = load.communicate(timeout=30)
        stats = json.loads(out)
        assert stats["errors"] == [] and stats["mismatches"] == 0, stats
        assert stats["stores"] > 20 and stats["retrieves"] > 20 and stats["read_tokens"] > 0, stats
        assert c.lookup(NS, pinned).tokens == 256  # pinned prefix kept through both shrinks
        st = s.http.get("/status").json()["l1"]
        assert st["capacity_bytes"] == 32 * PAGE and st["used_bytes"] <= 32 * PAGE and st["pinned_bytes"] == 4 * PAGE
        m = s.metrics()
        assert metric(m, "kvtier_evictions_total", tier="l1", reason="resize") > 0
        assert metric(m, "kvtier_request_errors_total", code="internal") == 0
        c.close()
    finally:
        s.stop()
    assert "Traceback" not in s.log_path.read_text()
