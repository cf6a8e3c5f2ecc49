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


def word_tokenizer(specials: list[str], num_words: int = 200, extra: tuple[str, ...] = ()):
    """A whitespace word-level tokenizer: <unk>, <s>, </s>, the specials, then w0..wN, then
    the `extra` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = (["<unk>", "<s>", "</s>", *specials] + [f"w{i}" for i in range(num_words)]
             + list(extra))
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


# Qwen3-VL's video timestamps "<1.5 seconds>" as words: "<1.5" and "seconds>"
TIMESTAMP_WORDS = tuple(f"<{i / 10:.1f}" for i in range(100)) + ("seconds>",)


def write_tiny_qwen3_vl(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-VL folder: patch 16, up to 8x8 patches an image, videos of up to
    2 x 4096 pixels a frame group, a tokenizer that knows the timestamp words."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok, vocab = word_tokenizer(QWEN_SPECIALS, extra=TIMESTAMP_WORDS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                              mrope_interleaved=True, rope_theta=10000.0),
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # Qwen3-VL's processor: Qwen2-VL's at patch 16, mean/std 0.5; up to 8x8 patches here
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             min_pixels=64 * 64, max_pixels=128 * 128,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 8 * 64 * 64},
                          cap_pixels_per_frame=False).save_pretrained(path)
    return path


def hf_greedy(model, input_ids: list[int], max_new_tokens: int, **mm) -> list[int]:
    """transformers' greedy tokens after input_ids (the processor's tensors in mm)."""
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, **mm)
    return out[0, len(input_ids):].tolist()


# ---- Idefics3 (SmolVLM) ----------------------------------------------------------------------
IDEFICS3_SPECIAL = (["<unk>", "<image>", "<fake_token_around_image>", "<global-img>"]
                    + [f"<row_{i}_col_{j}>" for i in range(1, 5) for j in range(1, 5)])
IDEFICS3_VOCAB = (IDEFICS3_SPECIAL + ["\n", "\n\n"]
                  + [f"w{i}" for i in range(256 - len(IDEFICS3_SPECIAL) - 2)])
IDEFICS3_TILE, IDEFICS3_PATCH = 32, 8


def tiny_idefics3_config():
    from transformers import Idefics3Config

    return Idefics3Config(
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 64, "patch_size": IDEFICS3_PATCH,
                       "image_size": IDEFICS3_TILE},
        text_config={"model_type": "llama", "vocab_size": len(IDEFICS3_VOCAB),
                     "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "intermediate_size": 128,
                     "max_position_embeddings": 256},
        scale_factor=2, image_token_id=IDEFICS3_VOCAB.index("<image>"),
        tie_word_embeddings=False, architectures=["Idefics3ForConditionalGeneration"])


def write_tiny_idefics3(path: Path, seed: int = 0):
    """A tiny random Idefics3 folder (tiles of IDEFICS3_TILE, a vocabulary with newline
    tokens); returns transformers' model that was saved."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import Idefics3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    torch.manual_seed(seed)
    hf = Idefics3ForConditionalGeneration(tiny_idefics3_config()).eval()
    randomize_weights(hf)
    hf.save_pretrained(path)
    vocab = {t: i for i, t in enumerate(IDEFICS3_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|[^\s]+"), "removed", invert=True)
    tok.add_special_tokens(IDEFICS3_SPECIAL)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    Idefics3ImageProcessorPil(size={"longest_edge": 2 * IDEFICS3_TILE},
                              max_image_size={"longest_edge": IDEFICS3_TILE}
                              ).save_pretrained(path)
    return hf


def noise_image(h: int, w: int, seed: int):
    """An h x w RGB image of seeded uniform noise (numpy's default_rng)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def record_placed(monkeypatch, llm) -> list[int]:
    """A list that fills, step by step, with the number of encoder rows the engine's
    runner places (the steps that place any)."""
    placed: list[int] = []
    mm = llm.llm_engine.core.runner.mm
    prepare = mm.prepare

    def recording(inp) -> None:
        prepare(inp)
        if inp.mm is not None and inp.mm.rows is not None:
            placed.append(int(inp.mm.rows.shape[0]))

    monkeypatch.setattr(mm, "prepare", recording)
    return placed
