"""`shoal serve` on a hybrid linear-attention model (a tiny random Qwen3-Next with SmolLM2's
tokenizer): chat and streamed completions through the official openai client, and the
linear-attention state gauges on /metrics."""

from __future__ import annotations

import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

TINY_NEXT = dict(
    vocab_size=49152, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_gguf):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("next"), "qwen3_next", **TINY_NEXT)
    folder, name = smollm_gguf
    srv = RemoteServer(str(path), "--tokenizer", f"{folder}/{name}",
                       "--dtype", "float32", base_args=[
                           "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512"])
    yield srv
    srv.stop()


def test_chat_and_streamed_completions(server) -> None:
    client = server.openai()
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "Name three rivers of Europe."}])
    assert chat.usage.completion_tokens == 16
    stream = client.completions.create(model=model, prompt="Once upon a time " * 20,
                                       temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in stream)
    # 3 linear layers, each (2 x 32 + 64 conv channels x 3 taps + 4 x 16 x 16) float32 words
    assert server.metric("linear_state_bytes_per_request") == 3 * 4 * (128 * 3 + 1024)
    assert server.metric("linear_state_blocks") >= 0
    assert "linear-attention states: 3 layers" in server.log_tail(200_000)
