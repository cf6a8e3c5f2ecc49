"""Integration tests on the real embedded SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0 / F32 tensors).

transformers can read the same GGUF itself (its own metadata-to-tokenizer converter and its own
loader, which also undoes llama.cpp's q/k permutation), so it serves as the reference.
"""

from __future__ import annotations

import pytest
import torch

from shoal.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; isn't it?",
    "def square(x):\n    return x ** 2  # comment\n\n\tif a != b:\n        pass\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }  // C++ "quoted"',
    "naïve café, Ærøskøbing, Straße, 日本語のテキスト, 中文, 한국어, Ελληνικά, русский",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "12345 3.14159 1,000,000 2024-01-01 x1y22z333 0x1F",
    "   leading and trailing spaces   ",
    "lines\n\n\n  indented\r\nCRLF\t\ttabs      many spaces",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "I'm sure you're right, they'll see; WE'VE DONE IT'S",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def reference_dir(ours) -> tuple[str, str]:
    from pathlib import Path

    path = Path(ours.source)
    return str(path.parent), path.name


@pytest.fixture(scope="module")
def reference_tokenizer(reference_dir, smollm_gguf, hf_smollm_tokenizer):
    # conftest's session-wide transformers tokenizer of this very file (test_detokenizer's
    # too: one ~4 s build for both)
    assert reference_dir == smollm_gguf
    return hf_smollm_tokenizer


def test_config(ours):
    config = ours.hf_config
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_tokenizer_equals_transformers(ours, reference_tokenizer):
    tok = ours.tokenizer
    for text in TEXTS:
        ids = reference_tokenizer.encode(text)
        assert tok.encode(text) == ids, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == reference_tokenizer.decode(
                ids, skip_special_tokens=skip
            ), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "eos_token_id"):
        assert getattr(tok, name) == getattr(reference_tokenizer, name), name
    assert len(tok) == len(reference_tokenizer) == 49152


def test_chat_template(ours, reference_tokenizer):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    ours_text = ours.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ref_text = reference_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours_text == ref_text
    assert ours_text.endswith("<|im_start|>assistant\n")
    ids = ours.tokenizer.encode(ours_text)
    assert ids == reference_tokenizer.encode(ref_text)
    assert ids.count(ours.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5  # incl. system


def test_weights_equal_transformers_gguf_loader(ours, reference_dir, smollm_gguf, hf_smollm):
    # The reference: conftest's session-wide transformers load of this very file (the oracle
    # of the other SmolLM2 tests too: one slow GGUF load for all of them).
    assert reference_dir == smollm_gguf
    reference = hf_smollm.state_dict()
    seen = set()
    for hf_name, tensor in ours.weights():
        seen.add(hf_name)
        expected = reference[hf_name]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, hf_name
        # Q4_1 projections (q/k un-permuted), Q8_0 embedding, F32 norms
        assert torch.allclose(tensor, expected, rtol=0, atol=1e-6), hf_name
    assert seen == set(reference) - {"lm_head.weight"}  # tied: the head is the embedding
    assert len(seen) == 272
