"""Tiny vision-language checkpoints with random weights, written as Hugging Face folders
(config, safetensors, a word-level tokenizer with the model's special tokens, the model's own
image processor config), and test images made from seeded noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from oracle import randomize_weights

QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                 "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def word_tokenizer(specials: list[str], num_words: int = 200):
    """A whitespace word-level tokenizer: <unk>, <s>, </s>, the specials, then w0..wN."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *specials] + [f"w{i}" for i in range(num_words)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHAT_TEMPLATE
    return tok, len(words)


def image(seed: int, width: int, height: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def write_tiny_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok, vocab = word_tokenizer(QWEN_SPECIALS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                              rope_theta=10000.0),
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[1], window_size=56,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(path)
    return path


def hf_greedy(model, input_ids: list[int], max_new_tokens: int, **mm) -> list[int]:
    """transformers' greedy tokens after input_ids (the processor's tensors in mm)."""
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, **mm)
    return out[0, len(input_ids):].tolist()
