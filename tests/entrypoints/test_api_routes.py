"""The app's routes and its key policy, in process on a stand-in engine (no model): every route
the app has, generated from its own route list, needs the key except the open probes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from shoal.core.types import SchedulerStats
from shoal.engine.engine_args import EngineArgs
from shoal.engine.request_checks import EngineLimits
from shoal.entrypoints.openai.api_server import build_app
from shoal.entrypoints.openai.auth import OPEN_PATHS
from shoal.entrypoints.openai.server_settings import ServerSettings

KEY = "sk-routes"


def stub_engine() -> SimpleNamespace:
    limits = EngineLimits(vocab_size=100, max_model_len=64, num_kv_blocks=8, block_size=16,
                          max_num_seqs=4)
    return SimpleNamespace(engine_args=EngineArgs(), max_model_len=64, vocab_size=100,
                           limits=limits, stat_loggers=[], tokenizer=None, is_healthy=True,
                           last_stats=SchedulerStats(), num_unfinished_requests=0)


def app_for(**settings) -> TestClient:
    s = ServerSettings(**settings)
    return TestClient(build_app(stub_engine(), s), raise_server_exceptions=False)


def routes(client: TestClient) -> list[tuple[str, str]]:
    out = []
    for r in client.app.routes:
        if isinstance(r, (APIRoute, Route)):
            out += [(r.path, m) for m in sorted(r.methods or ()) if m != "HEAD"]
    return out


@pytest.fixture(scope="module")
def keyed() -> TestClient:
    return app_for(api_key=KEY, enable_tokenizer_info_endpoint=True,
                   enable_server_load_tracking=True, root_path="/llm")


def test_every_route_but_the_probes_needs_the_key(keyed):
    found = routes(keyed)
    paths = {p for p, _ in found}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
            "/v1/responses", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations",
            "/v1/models", "/openapi.json", "/docs"} <= paths
    assert OPEN_PATHS <= paths
    for path, method in found:
        for prefix in ("", "/llm"):  # with --root-path the prefixed path is the same route
            url = prefix + path.replace("{model_id:path}", "m").replace("{response_id}", "r")
            r = keyed.request(method, url, json={})
            if path in OPEN_PATHS:
                assert r.status_code != 401, (url, method)
            else:
                assert r.status_code == 401, (url, method, r.status_code)
                assert r.json()["error"]["code"] == 401
    assert keyed.get("/no-such-route").status_code == 401  # a probe learns nothing


def test_open_routes_answer_without_the_key(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/ping").status_code == 200 and keyed.post("/ping").status_code == 200
    assert keyed.get("/version").json()["version"]
    assert "vllm:num_requests_running" in keyed.get("/metrics").text
    assert keyed.get("/load").json() == {"server_load": 0}


def test_key_passes(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert keyed.get("/v1/models", headers=auth).status_code == 200
    assert keyed.get("/llm/v1/models", headers=auth).status_code == 200


def test_vllm_api_key_environment_variable(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert ServerSettings().api_key == "from-env"
    assert ServerSettings(api_key="flag").api_key == "flag"


def test_optional_routes_and_flags():
    plain = app_for()
    paths = {p for p, _ in routes(plain)}
    assert "/tokenizer_info" not in paths  # only behind --enable-tokenizer-info-endpoint
    assert plain.get("/load").status_code == 404  # only with --enable-server-load-tracking
    assert "x-request-id" not in plain.get("/health").headers
    ids = app_for(enable_request_id_headers=True)
    assert len(ids.get("/health").headers["x-request-id"]) == 32
    assert ids.get("/health", headers={"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"


def test_settings_refuse_what_shoal_cannot_do():
    with pytest.raises(ValueError, match="--api-server-count must be in 1..64"):
        ServerSettings(api_server_count=0)
    with pytest.raises(ValueError, match="metrics_prefixes"):
        ServerSettings(metrics_prefixes=["prom"])
    assert ServerSettings(root_path="llm/").root_path == "/llm"


def test_return_tokens_as_token_ids_flag_is_the_default_a_request_overrides():
    from shoal.entrypoints.openai.serving_common import ServingBase

    engine = stub_engine()
    engine.tokenizer = object()
    flag = ServingBase(engine, None, ServerSettings(return_tokens_as_token_ids=True))
    assert flag.token_decoder(None) is None  # "token_id:N"
    assert flag.token_decoder(False) is not None
    plain = ServingBase(engine, None, ServerSettings())
    assert plain.token_decoder(None) is not None and plain.token_decoder(True) is None
