"""`shoal serve --grpc-port`: a Python client generated here from the shipped proto (not the
committed stubs) streams the HTTP server's greedy tokens for token-id and text prompts, aborts
by cancelling and by Abort (the engine's running count back to 0), gets INVALID_ARGUMENT with
the validator's message, needs the API key (Health excepted); Health, GetModelInfo and
GetServerInfo agree with the HTTP routes. The committed stubs equal a fresh generation."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
import re
import signal
import sys
import time
import tomllib
from pathlib import Path

import grpc
import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer, free_port

ROOT = Path(__file__).resolve().parents[2]
GRPC_DIR = Path(importlib.util.find_spec("shoal.entrypoints.grpc").submodule_search_locations[0])
PROTO = GRPC_DIR / "shoal_engine.proto"
KEY = "grpc-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]
IDS = [17, 2034, 330, 4023, 9, 88, 1500]
TEXT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module")
def client_modules(tmp_path_factory):
    """pb2 and pb2_grpc compiled by grpc_tools.protoc from the proto the package ships."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("grpc-client")
    rc = protoc.main(["protoc", f"-I{GRPC_DIR}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(PROTO)])
    assert rc == 0
    # A private descriptor pool: the server's own pb2 may already be in the default one (an
    # in-process server in another test module), and one pool refuses the same symbols twice.
    pb2 = out / "shoal_engine_pb2.py"
    pb2.write_text(pb2.read_text().replace("_descriptor_pool.Default()",
                                           "_descriptor_pool.DescriptorPool()"))
    sys.path.insert(0, str(out))
    try:
        return (importlib.import_module("shoal_engine_pb2"),
                importlib.import_module("shoal_engine_pb2_grpc"))
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_gguf):
    base = write_tiny_checkpoint(tmp_path_factory.mktemp("grpc-model"), "llama", seed=0,
                                 vocab_size=49152)
    folder, name = smollm_gguf
    grpc_port = free_port()
    srv = RemoteServer(str(base), "--tokenizer", f"{folder}/{name}", "--dtype", "float32",
                       "--grpc-port", str(grpc_port), api_key=KEY,
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "512", "--disable-uvicorn-access-log"])
    srv.grpc_port = grpc_port
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server, client_modules):
    pb, pb_grpc = client_modules
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield pb, pb_grpc.EngineStub(channel)
    channel.close()


def _greedy(pb, max_tokens: int = STEPS, **kw):
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _http_greedy(server, prompt) -> tuple[list[int], list[int]]:
    r = server.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def _running(api) -> int:
    pb, stub = api
    return stub.Health(pb.HealthRequest()).num_running


def _aborted(server) -> float:
    """Requests the engine ended as aborted (vLLM's request_success_total by reason)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get("/metrics").text.splitlines()
               if line.startswith("shoal:request_success_total{")
               and 'finished_reason="abort"' in line)


def _wait_idle(api, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while _running(api) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(api)


# ---- the stubs and the package ----------------------------------------------------------------
def _without_versions(text: str) -> str:
    """A stub without the generator's version numbers (they name grpcio-tools' release)."""
    text = re.sub(r"# Protobuf Python Version: .*\n", "", text)
    text = re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "ValidateProtobufRuntimeVersion()",
                  text)
    return re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", text)


def test_committed_stubs_equal_a_fresh_generation(tmp_path):
    from shoal.entrypoints.grpc.generate import STUBS, generate

    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    assert sorted(fresh) == sorted(STUBS)
    for name, text in fresh.items():
        committed = (GRPC_DIR / name).read_text()
        assert _without_versions(committed) == _without_versions(text), (
            f"{name} is stale: run `python -m shoal.entrypoints.grpc.generate`")


def test_the_proto_ships_with_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["shoal"]
    rel = PROTO.relative_to(ROOT / "shoal").as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs), globs


# ---- generation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ids", "text"])
def test_generate_streams_the_http_greedy_tokens(server, api, kind):
    pb, stub = api
    prompt = IDS if kind == "ids" else TEXT
    want_prompt, want = _http_greedy(server, prompt)
    req = pb.GenerateRequest(request_id=f"greedy-{kind}", sampling_params=_greedy(pb))
    if kind == "ids":
        req.prompt_token_ids.ids.extend(IDS)
    else:
        req.text = TEXT
    msgs = list(stub.Generate(req, metadata=AUTH, timeout=60))
    got = [t for m in msgs for t in m.token_ids]
    assert got == want and len(got) == STEPS
    assert [m.finish_reason for m in msgs] == [""] * (len(msgs) - 1) + ["length"]
    assert all(m.request_id == f"greedy-{kind}" for m in msgs)
    last = msgs[-1]
    assert last.prompt_tokens == len(want_prompt) and last.completion_tokens == STEPS


def test_generate_logprobs(api):
    pb, stub = api
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS),
                             sampling_params=_greedy(pb, logprobs=3))
    msgs = list(stub.Generate(req, metadata=AUTH, timeout=60))
    ids = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == len(ids) == STEPS
    for t, lp in zip(ids, lps):
        assert [x.rank for x in lp.top] == [1, 2, 3]
        assert lp.rank == 1 and lp.top[0].token_id == t  # greedy: the best token
        assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.logprob <= 0


def test_client_cancel_aborts_in_the_engine(server, api):
    pb, stub = api
    aborted = _aborted(server)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS),
                             sampling_params=_greedy(pb, max_tokens=480))
    call = stub.Generate(req, metadata=AUTH, timeout=60)
    first = next(call)
    assert first.token_ids and not first.finish_reason
    assert _running(api) == 1  # it is generating
    call.cancel()
    assert _wait_idle(api) == 0
    assert _aborted(server) == aborted + 1  # stopped, not run to its 480 tokens


def test_abort_method_ends_the_stream(server, api):
    pb, stub = api
    aborted = _aborted(server)
    req = pb.GenerateRequest(request_id="abort-me", prompt_token_ids=pb.TokenIds(ids=IDS),
                             sampling_params=_greedy(pb, max_tokens=480))
    call = stub.Generate(req, metadata=AUTH, timeout=60)
    assert next(call).token_ids
    with pytest.raises(grpc.RpcError) as err:  # the id is taken while it runs
        list(stub.Generate(req, metadata=AUTH, timeout=60))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH).found
    rest = list(call)
    assert rest and rest[-1].finish_reason == "abort"
    assert rest[-1].completion_tokens < 480
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH).found
    assert _wait_idle(api) == 0
    assert _aborted(server) == aborted + 1


# ---- errors and the API key -------------------------------------------------------------------
def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not hasattr(result, "ByteSize"):  # a stream: errors come while reading it
            list(result)
    return err.value


def test_bad_requests_are_invalid_argument(api):
    from shoal.sampling_params import SamplingParams

    pb, stub = api
    with pytest.raises(ValueError) as want:
        SamplingParams(top_p=2.0)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS),
                             sampling_params=pb.SamplingParams(top_p=2.0))
    err = _error(lambda: stub.Generate(req, metadata=AUTH, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == str(want.value)
    err = _error(lambda: stub.Generate(pb.GenerateRequest(), metadata=AUTH, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details()
    too_long = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS * 80))
    err = _error(lambda: stub.Generate(too_long, metadata=AUTH, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    unknown = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS), model="nope")
    err = _error(lambda: stub.Generate(unknown, metadata=AUTH, timeout=30))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.details()


def test_api_key_is_required(api):
    pb, stub = api
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS), sampling_params=_greedy(pb))
    for metadata, message in ((None, "missing API key"),
                              ([("authorization", "Bearer wrong")], "invalid API key")):
        for call in (lambda m=metadata: stub.Generate(req, metadata=m, timeout=30),
                     lambda m=metadata: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=m),
                     lambda m=metadata: stub.Abort(pb.AbortRequest(request_id="x"), metadata=m)):
            err = _error(call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in err.details()
    assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING  # open
    assert list(stub.Generate(req, metadata=AUTH, timeout=60))[-1].finish_reason == "length"


# ---- health and discovery ---------------------------------------------------------------------
def test_health_is_serving(api):
    pb, stub = api
    h = stub.Health(pb.HealthRequest())
    assert h.status == pb.HealthResponse.SERVING and h.reason == ""
    assert h.num_waiting == 0


def test_model_info_matches_v1_models(server, api):
    pb, stub = api
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    cards = server.get("/v1/models").json()["data"]
    assert list(info.served_model_names) + list(info.lora_adapters) == [c["id"] for c in cards]
    assert info.max_model_len == cards[0]["max_model_len"] == 512
    assert info.vocab_size == 49152 and info.has_tokenizer


def test_server_info(server, api):
    pb, stub = api
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH)
    assert info.version == server.get("/version").json()["version"]
    assert info.http_address == server.base_url
    assert not info.HasField("kv_events_address")  # no KV event publisher configured
    assert info.data_parallel_size == 1


def test_engine_death_is_not_serving_and_unavailable(server, api):
    """Last in the module, as it kills the module server's engine (a server of its own was
    another start): Health turns NOT_SERVING with the reason and a stream in flight, like a
    new request, ends with UNAVAILABLE."""
    pb, stub = api
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=IDS),
                             sampling_params=_greedy(pb, max_tokens=480))
    call = stub.Generate(req, metadata=AUTH, timeout=60)
    assert next(call).token_ids
    os.kill(server.engine_pid(), signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    h = stub.Health(pb.HealthRequest(), timeout=5)  # the server lingers 2 s
    assert h.status == pb.HealthResponse.NOT_SERVING
    assert h.reason.startswith("engine dead"), h.reason
    err = _error(lambda: stub.Generate(req, metadata=AUTH, timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_unset_sampling_fields_take_the_generation_config_s():
    from shoal.entrypoints.grpc import shoal_engine_pb2 as pb
    from shoal.entrypoints.grpc.server import sampling_params

    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 8}
    sp = sampling_params(pb.SamplingParams(top_k=5, max_tokens=32), defaults)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.6, 5, 8)  # max_tokens capped
    sp = sampling_params(pb.SamplingParams(temperature=0.0), defaults)
    assert (sp.temperature, sp.max_tokens) == (0.0, 8)
    assert sampling_params(pb.SamplingParams()).temperature == 1.0
