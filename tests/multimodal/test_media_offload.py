"""Media work stays off the server's event loop: with the image processor slowed to seconds
(monkeypatched) for one chat request, the server answers /health and streams another
request's tokens within a small bound meanwhile, and the slow request still completes. The
server runs in this process (uvicorn on a thread, the engine core in its own process as
`shoal serve` has it) so the processor can be patched. Also: the media thread count's
argument and environment variable, and a text model's frontend that never imports PIL or
PyAV."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from vl_checkpoints import image, write_tiny_qwen2_5_vl

from shoal.engine.engine_args import EngineArgs
from shoal.engine.mm_frontend import MEDIA_THREADS_ENV, default_media_threads

SLOW_S = 2.0  # the patched processor's sleep (a stalled loop: /health alone takes it)
BOUND_S = 1.0  # what the other requests may take meanwhile


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """build_app + uvicorn on a thread with its own event loop."""

    def __init__(self, args: EngineArgs):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server = None
        self._thread = threading.Thread(target=self._main, args=(args,), daemon=True)
        self._thread.start()
        if not self._ready.wait(180) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error!r}")

    def _main(self, args: EngineArgs) -> None:
        try:
            asyncio.run(self._serve(args))
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            self._error = e
            self._ready.set()

    async def _serve(self, args: EngineArgs) -> None:
        import uvicorn

        from shoal.engine.async_llm import AsyncLLM
        from shoal.entrypoints.openai.api_server import build_app
        from shoal.entrypoints.openai.server_settings import ServerSettings

        engine = await AsyncLLM.from_engine_args(args)
        try:
            app = build_app(engine, ServerSettings(port=self.port))
            self._server = uvicorn.Server(uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"))
            task = asyncio.create_task(self._server.serve())
            while not self._server.started and not task.done():
                await asyncio.sleep(0.02)
            self._ready.set()
            await task
        finally:
            await engine.shutdown()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[InProcessServer]:
    folder = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("offload"))
    srv = InProcessServer(EngineArgs(model=str(folder), dtype="float32", max_model_len=512,
                                     kv_cache_memory_bytes=16 << 20, media_io_threads=2))
    yield srv
    srv.stop()


def _image_url() -> str:
    buf = io.BytesIO()
    image(1, 60, 50).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(content, stream: bool = False, max_tokens: int = 4) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def test_a_slow_processor_does_not_stall_other_requests(server, monkeypatch) -> None:
    from shoal.multimodal.processors.qwen_vl import QwenVLProcessor

    with httpx.Client(base_url=server.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {**_chat("w1 w2"), "model": model}
        assert c.post("/v1/chat/completions", json=body).status_code == 200  # warm

    entered = threading.Event()
    process = QwenVLProcessor.process

    def slow(self, *args, **kw):
        entered.set()
        time.sleep(SLOW_S)
        return process(self, *args, **kw)

    monkeypatch.setattr(QwenVLProcessor, "process", slow)
    result: dict = {}

    def image_request() -> None:
        t0 = time.monotonic()
        parts = [{"type": "image_url", "image_url": {"url": _image_url()}},
                 {"type": "text", "text": "w3"}]
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={**_chat(parts), "model": model}, timeout=60)
        result.update(status=r.status_code, elapsed=time.monotonic() - t0, body=r.text)

    slow_thread = threading.Thread(target=image_request)
    slow_thread.start()
    assert entered.wait(30), "the image request never reached the processor"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200
        health_s = time.monotonic() - t0
        t0 = time.monotonic()
        tokens = 0
        with c.stream("POST", "/v1/chat/completions",
                      json={**_chat("w4 w5", stream=True, max_tokens=8), "model": model}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
        stream_s = time.monotonic() - t0
    slow_thread.join(60)
    assert result["status"] == 200, result["body"]
    assert result["elapsed"] >= SLOW_S  # it was slow, and the others ran meanwhile:
    assert health_s < BOUND_S, f"/health took {health_s:.2f} s behind a slow image"
    assert tokens > 0 and stream_s < BOUND_S, f"a stream took {stream_s:.2f} s"


def test_media_thread_settings(monkeypatch) -> None:
    monkeypatch.setenv(MEDIA_THREADS_ENV, "3")
    assert default_media_threads() == 3
    monkeypatch.setenv(MEDIA_THREADS_ENV, "0")
    with pytest.raises(ValueError, match=MEDIA_THREADS_ENV):
        default_media_threads()
    monkeypatch.delenv(MEDIA_THREADS_ENV)
    assert 1 <= default_media_threads() <= 4
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="media_io_threads"):
            EngineArgs(model="x", media_io_threads=bad)


# transformers 5.25 imports PIL itself (`import transformers` probes is_vision_available by
# importing PIL.Image), so the probe refuses PIL and PyAV to everyone and records who asked:
# transformers carries on without them; no shoal module may ask.
_PROBE = """
import sys

asked = []


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ("PIL", "av"):
            return None
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        asked.append((name, frame.f_globals.get("__name__", "?")))
        raise ImportError(f"{name} refused by the probe")


sys.meta_path.insert(0, Refuse())
import shoal.engine.async_llm, shoal.engine.llm_engine, shoal.engine.mm_frontend
import shoal.entrypoints.openai.api_server, shoal.entrypoints.openai.server_launch
from shoal.engine.engine_args import EngineArgs
from shoal.engine.mm_frontend import MultiModalFrontend
from shoal.loader import load_frontend_tokenizer
args = EngineArgs()  # the default model (SmolLM2, text)
tokenizer = load_frontend_tokenizer(args.model, args.tokenizer)
assert MultiModalFrontend.build(args.model, tokenizer, 0, args) is None
assert tokenizer.encode("hello") and tokenizer.apply_chat_template(
    [{"role": "user", "content": "hi"}], tokenize=False) is not None
print(sorted(m for m in sys.modules if m.split(".")[0] in ("PIL", "av")))
print(sorted({who for _, who in asked if who.split(".")[0] == "shoal"}))
"""


def test_a_text_frontend_imports_neither_pil_nor_av(smollm_gguf) -> None:
    """One probe run (a start of the engine modules each is seconds) with an eager import
    planted first: the probe names it (so it would name a shoal module's), and names no
    other."""
    eager = ("try:\n    exec('from PIL import Image', {'__name__': 'shoal.eager'})\n"
             "except ImportError:\n    pass\n")
    probe = _PROBE.replace("import shoal.engine.async_llm,", eager + "import shoal.engine.async_llm,")
    out = subprocess.run([sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, shoal_importers = out.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", loaded
    assert shoal_importers == "['shoal.eager']", f"shoal modules import PIL or av: {shoal_importers}"
