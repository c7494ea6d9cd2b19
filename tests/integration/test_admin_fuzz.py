"""Property-based fuzz of every admin route (hypothesis, schema-guided from /openapi.json): never a 5xx."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_admin_api import AUTH, NS, TOKEN, Server, clean_env, doc, store

pytestmark = pytest.mark.integration

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=40), st.sampled_from(["all", "namespace", "tier", "l1", "l2", "lru", "lirs", "reuse", "debug", "00" * 16,
                                           NS.fingerprint().hex(), "ab" * 16, "", NS.model, "tenant", "*",
                                           "A=10%:50%", "*=0:1MiB", "A=1GiB"]),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10),
                                                                                                   inner, max_size=5),
                           max_leaves=20)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("fuzz"), env=clean_env(KVTIER_ADMIN_TOKEN=TOKEN))
    c = s.client(token=TOKEN)
    store(c, doc(1, 256))
    yield s
    c.close()
    s.stop()
    assert "Traceback" not in s.log_path.read_text()


def post_bodies(schema: dict, path: str) -> st.SearchStrategy:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    props = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    names = st.sampled_from([*props, "extra"])
    near_valid = st.dictionaries(names, json_values | st.lists(st.integers(-5, 2**33), max_size=30), max_size=4)
    return st.one_of(near_valid, json_values)


def test_fuzz_no_5xx(srv):
    schema = srv.http.get("/openapi.json").json()
    posts = [p for p, ops in schema["paths"].items() if "post" in ops]
    gets = [p for p, ops in schema["paths"].items() if "get" in ops]
    assert set(posts) == {"/cache/clear", "/cache/pin", "/cache/unpin", "/cache/lookup", "/reconfigure"}
    bodies = st.one_of(*[st.tuples(st.just(p), post_bodies(schema, p)) for p in posts])
    headers = st.sampled_from([AUTH, {}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}])

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies, headers, st.booleans(), st.binary(max_size=64))
    def check_post(path_body, hdrs, raw, junk):
        path, body = path_body
        content = junk if raw else json.dumps(body, allow_nan=True).encode()
        r = srv.http.post(path, content=content, headers={**hdrs, "content-type": "application/json"})
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if hdrs is not AUTH:
            assert r.status_code in (401, 403)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(gets), st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3))
    def check_get(path, params):
        r = srv.http.get(path, params=params)
        assert r.status_code < 500, (path, params, r.status_code)

    check_post()
    check_get()
    assert srv.http.get("/healthz").status_code == 200
