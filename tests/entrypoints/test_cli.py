"""The command line: flags map to EngineArgs/ServerSettings; the chat loop (fake engine)."""

from __future__ import annotations

import io

from shoal.cli import build_parser
from shoal.engine.engine_args import EngineArgs
from shoal.entrypoints.chat_cli import chat_loop
from shoal.entrypoints.cli_args import engine_args_from, sampling_params_from, server_settings_from
from shoal.outputs import CompletionOutput, RequestOutput


def test_serve_defaults():
    ns = build_parser().parse_args(["serve"])
    s = server_settings_from(ns)
    assert (s.host, s.port, s.api_key, s.shutdown_timeout) == ("127.0.0.1", 8000, None, 30.0)
    assert s.served_model_name is None  # the server reports the model argument
    assert engine_args_from(ns) == EngineArgs()


def test_serve_flags_use_vllm_names():
    ns = build_parser().parse_args([
        "serve", "m.gguf", "--port", "9", "--api-key", "k", "--served-model-name", "a", "b",
        "--max-model-len", "512", "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
        "--gpu-memory-utilization", "0.5", "--block-size", "32", "--no-enable-prefix-caching",
        "--dtype", "bfloat16", "--tensor-parallel-size", "1", "--seed", "7",
        "--load-format", "dummy", "--tokenizer", "t", "--kv-cache-memory-bytes", "1024",
        "--max-waiting-requests", "5", "--shutdown-timeout", "2.5"])
    a = engine_args_from(ns)
    assert (a.model, a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens) == \
        ("m.gguf", 512, 3, 64)
    assert (a.gpu_memory_utilization, a.block_size, a.enable_prefix_caching, a.dtype) == \
        (0.5, 32, False, "bfloat16")
    assert (a.seed, a.load_format, a.tokenizer, a.kv_cache_memory_bytes) == \
        (7, "dummy", "t", 1024)
    assert a.max_waiting_requests == 5
    s = server_settings_from(ns)
    assert (s.port, s.api_key, s.served_model_name, s.shutdown_timeout) == \
        (9, "k", ["a", "b"], 2.5)


def test_serve_takes_vllm_s_stats_and_generation_config_flags():
    ns = build_parser().parse_args([
        "serve", "--disable-log-stats", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.5}'])
    a = engine_args_from(ns)
    assert (a.disable_log_stats, a.generation_config, a.override_generation_config) == \
        (True, "vllm", {"temperature": 0.5})


def test_serve_kv_offloading_flags():
    ns = build_parser().parse_args([
        "serve", "--kv-offloading-size", "1.5", "--kv-offloading-disk-path", "/tmp/kv",
        "--kv-offloading-disk-size", "4", "--kv-offloading-policy", "arc"])
    a = engine_args_from(ns)
    assert (a.kv_offloading_size, a.kv_offloading_disk_path, a.kv_offloading_disk_size,
            a.kv_offloading_policy) == (1.5, "/tmp/kv", 4.0, "arc")


def test_generate_flags():
    ns = build_parser().parse_args(["generate", "--prompt", "a", "--prompt", "b",
                                    "--max-tokens", "3", "--temperature", "0.5"])
    assert ns.prompt == ["a", "b"]
    p = sampling_params_from(ns)
    assert (p.max_tokens, p.temperature) == (3, 0.5)


class FakeEngine:
    """Replies 'ok' in two deltas to every turn; records the conversations it saw."""

    def __init__(self):
        self.seen: list[list[dict]] = []
        self.inputs = self
        self._pending: list[RequestOutput] = []

    def process_chat(self, messages):
        self.seen.append([dict(m) for m in messages])
        return "prompt"

    def add_request(self, rid, prompt, params, kind):
        def out(text, done):
            c = CompletionOutput(0, text, [1], None, None, "stop" if done else None)
            return RequestOutput(rid, None, [1], None, [c], done)

        self._pending = [out("o", False), out("k", True)]

    def has_unfinished_requests(self):
        return bool(self._pending)

    def step(self):
        return [self._pending.pop(0)]


def test_chat_keeps_the_conversation_and_streams():
    engine = FakeEngine()
    out = io.StringIO()
    code = chat_loop(engine, sampling_params_from(build_parser().parse_args(["chat"])),
                     [{"role": "system", "content": "be brief"}],
                     io.StringIO("hi\n\nagain\n"), out)
    assert code == 0
    assert out.getvalue() == "ok\nok\n"
    assert engine.seen[-1] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]


def test_every_engine_argument_is_a_serve_flag_with_help():
    from dataclasses import fields

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    by_dest = {a.dest: a for a in serve._actions}
    for f in fields(EngineArgs):
        assert f.metadata.get("help"), f"EngineArgs.{f.name} has no help text"
        action = by_dest[f.name]
        assert action.default == f.default
        if f.name != "model":
            assert "--" + f.name.replace("_", "-") in action.option_strings


def test_kernel_switches_are_flags_not_environment():
    ns = build_parser().parse_args(["serve", "--attention-backend", "torch",
                                    "--no-use-triton-ops", "--no-fuse-rope-kv-write"])
    a = engine_args_from(ns)
    assert (a.attention_backend, a.use_triton_ops, a.fuse_rope_kv_write) == \
        ("torch", False, False)
