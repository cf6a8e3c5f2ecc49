"""thinking_token_budget through `shoal serve --reasoning-parser qwen3`: a tiny random Llama
whose tokenizer is SmolLM2's plus <think> and </think>. The random model never closes its
thought, so the budget decides where reasoning_content ends; the answer follows in content."""

from __future__ import annotations

import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from shoal.loader import load_frontend_tokenizer

    folder = tmp_path_factory.mktemp("think")
    tok = load_frontend_tokenizer(None, None)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(folder)
    write_tiny_checkpoint(folder, "llama", seed=0, vocab_size=len(tok))
    srv = RemoteServer(str(folder), "--dtype", "float32", "--reasoning-parser", "qwen3",
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "512"])
    yield srv, tok
    srv.stop()


def test_budget_ends_reasoning_and_answers(server) -> None:
    srv, tok = server
    r = srv.post("/v1/chat/completions", json={
        # the assistant turn opens its thought, as a thinking model's template does
        "messages": [{"role": "user", "content": "Think, then answer."},
                     {"role": "assistant", "content": "<think>"}],
        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 40,
        "temperature": 0, "ignore_eos": True, "thinking_token_budget": 16,
        "return_token_ids": True, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    end = tok.convert_tokens_to_ids("</think>")
    assert ids.index(end) == 16 and len(ids) == 40
    msg = choice["message"]
    assert msg["reasoning_content"] and msg["content"]
    assert tok.decode(ids[:16]).strip() in msg["reasoning_content"]
