"""The gRPC control plane over TLS (--grpc-ssl-certfile/--grpc-ssl-keyfile, mutual TLS with
--grpc-ssl-ca-certs), with certificates made here by the openssl command: a client compiled
from the shipped proto streams tokens over TLS (a model-free engine core behind a real
AsyncLLM), still needs the API key, and a plaintext client is refused; with client
certificates required, a client without one is refused and one with it served. Bad TLS
settings fail at start with the flag's name."""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from shoal.entrypoints.openai.server_settings import ServerSettings

from .conftest import free_port

GRPC_DIR = Path(importlib.util.find_spec("shoal.entrypoints.grpc").submodule_search_locations[0])
KEY = "tls-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """Self-signed P-256 certificates: the server's (for 127.0.0.1) and a client's (its own
    CA for mutual TLS)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test certificates)")
    out = tmp_path_factory.mktemp("tls")
    for name, san in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:client")):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                        "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
                        "-keyout", str(out / f"{name}.key"), "-out", str(out / f"{name}.pem")],
                       check=True, capture_output=True)
    return {f"{n}.{ext}": out / f"{n}.{ext}" for n in ("server", "client")
            for ext in ("key", "pem")}


@pytest.fixture(scope="module")
def client_modules(tmp_path_factory):
    """pb2 and pb2_grpc compiled by grpc_tools.protoc from the proto the package ships (a
    private descriptor pool: the server's own pb2 is in the default one)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("grpc-tls-client")
    assert protoc.main(["protoc", f"-I{GRPC_DIR}", f"--python_out={out}",
                        f"--grpc_python_out={out}", str(GRPC_DIR / "shoal_engine.proto")]) == 0
    pb2 = out / "shoal_engine_pb2.py"
    pb2.write_text(pb2.read_text().replace("_descriptor_pool.Default()",
                                           "_descriptor_pool.DescriptorPool()"))
    sys.path.insert(0, str(out))
    try:
        return (importlib.import_module("shoal_engine_pb2"),
                importlib.import_module("shoal_engine_pb2_grpc"))
    finally:
        sys.path.remove(str(out))


def _credentials(certs: dict[str, Path], client_cert: bool = False
                 ) -> grpc.ChannelCredentials:
    mine = ({"private_key": certs["client.key"].read_bytes(),
             "certificate_chain": certs["client.pem"].read_bytes()} if client_cert else {})
    return grpc.ssl_channel_credentials(root_certificates=certs["server.pem"].read_bytes(),
                                        **mine)


async def _generate(channel: grpc.aio.Channel, pb: Any, pb_grpc: Any, metadata: Any = AUTH
                    ) -> list[Any]:
    stub = pb_grpc.EngineStub(channel)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[11, 12, 13]),
                             sampling_params=pb.SamplingParams(max_tokens=5, ignore_eos=True))
    return [m async for m in stub.Generate(req, metadata=metadata, timeout=20)]


async def _refused(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def test_tls_streams_tokens_and_refuses_plaintext(certs, client_modules) -> None:
    from shoal.benchmarks.null_engine import build_null_core
    from shoal.engine.async_llm import AsyncLLM
    from shoal.engine.engine_args import EngineArgs
    from shoal.entrypoints.grpc.server import start_grpc_server
    from shoal.entrypoints.openai.serving_models import ServedModels

    pb, pb_grpc = client_modules

    async def run() -> None:
        args = EngineArgs(device="cpu", max_num_seqs=4, max_model_len=256, cpu_threads=1,
                          skip_tokenizer_init=True)
        build = functools.partial(build_null_core, step_time_s=0.002, vocab_size=1000)
        engine = await AsyncLLM.from_engine_args(args, build_core=build, startup_timeout=60,
                                                 log_stats_interval=3600)
        models = ServedModels(["m"], None, 256)
        tls = ServerSettings(grpc_port=free_port(), api_key=KEY,
                             grpc_ssl_certfile=str(certs["server.pem"]),
                             grpc_ssl_keyfile=str(certs["server.key"]))
        mtls = ServerSettings(grpc_port=free_port(), api_key=KEY,
                              grpc_ssl_certfile=str(certs["server.pem"]),
                              grpc_ssl_keyfile=str(certs["server.key"]),
                              grpc_ssl_ca_certs=str(certs["client.pem"]))
        planes = []
        try:
            for s in (tls, mtls):
                planes.append(await start_grpc_server(engine, models, s, lambda: False))
            addr, maddr = f"127.0.0.1:{tls.grpc_port}", f"127.0.0.1:{mtls.grpc_port}"
            async with grpc.aio.secure_channel(addr, _credentials(certs)) as ch:
                msgs = await _generate(ch, pb, pb_grpc)
                assert sum(len(m.token_ids) for m in msgs) == 5 and len(msgs) >= 2
                assert msgs[-1].finish_reason == "length"
                assert await _refused(_generate(ch, pb, pb_grpc, metadata=None)) == \
                    grpc.StatusCode.UNAUTHENTICATED  # TLS does not replace the API key
            async with grpc.aio.insecure_channel(addr) as ch:  # Health needs no key
                health = pb_grpc.EngineStub(ch).Health(pb.HealthRequest(), timeout=5)
                assert await _refused(health) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(maddr, _credentials(certs)) as ch:
                assert await _refused(_generate(ch, pb, pb_grpc)) == \
                    grpc.StatusCode.UNAVAILABLE  # no client certificate
            async with grpc.aio.secure_channel(maddr, _credentials(certs, True)) as ch:
                msgs = await _generate(ch, pb, pb_grpc)
                assert sum(len(m.token_ids) for m in msgs) == 5
        finally:
            for p in planes:
                await p.stop(0)
            await engine.shutdown()

    asyncio.run(run())


def test_bad_tls_settings_name_the_flag(certs) -> None:
    from shoal.entrypoints.grpc.tls import TlsFiles, server_credentials

    cert, key = str(certs["server.pem"]), str(certs["server.key"])
    for kw, message in (
            ({"grpc_ssl_certfile": cert}, "grpc_ssl_keyfile must be set with grpc_ssl_certfile"),
            ({"grpc_ssl_keyfile": key}, "grpc_ssl_certfile must be set with grpc_ssl_keyfile"),
            ({"grpc_ssl_ca_certs": cert}, "grpc_ssl_ca_certs needs grpc_ssl_certfile"),
            ({"grpc_ssl_certfile": cert, "grpc_ssl_keyfile": key, "grpc_port": None},
             "grpc_ssl_certfile needs grpc_port")):
        with pytest.raises(ValueError, match=message):
            ServerSettings(**{"grpc_port": 50051, **kw})
    with pytest.raises(ValueError, match="--grpc-ssl-keyfile: cannot read"):
        server_credentials(TlsFiles(cert, str(certs["server.key"]) + ".missing"))
    with pytest.raises(ValueError, match="not a PEM certificate chain and its private key"):
        server_credentials(TlsFiles(cert, str(certs["client.key"])))  # another cert's key
    with pytest.raises(ValueError, match="--grpc-ssl-ca-certs .* holds no PEM CA"):
        server_credentials(TlsFiles(cert, key, key))
