"""Write tiny GGUF files for loader tests, mimicking what llama.cpp's converter produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16
Q8_0 = GGMLQuantizationType.Q8_0

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinySpec:
    arch: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    layers: int = 2
    tied: bool = True
    matrix_type: GGMLQuantizationType = Q8_0  # type of the big projection matrices
    tokenizer: str | None = "gpt2"  # "gpt2", "llama" (SentencePiece) or None
    pre: str = "smollm"
    context_length: int = 256
    rope_theta: float = 10000.0
    extra_metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class TinyModel:
    path: Path
    spec: TinySpec
    original: dict[str, np.ndarray]  # HF-layout weights before any quantization
    expected: dict[str, np.ndarray]  # what the loader must yield (original after quant round trip)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    shift = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shift)
            shift += 1
    return table


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to q/k rows (written from its description)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ Ġ", "o r", "Ġ w", "Ġw or", "l d", "1 2"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = control + alphabet + merged + ["<think>"]
    types = [3] * len(control) + [1] * (len(alphabet) + len(merged)) + [4]
    return tokens, types, merges


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "in", "▁a", "▁in", "er", "▁w"]
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, types, scores


def write_tiny_gguf(path: Path, spec: TinySpec | None = None, seed: int = 0) -> TinyModel:
    spec = spec or TinySpec()
    rng = np.random.default_rng(seed)
    vocab = _write_tokenizer_vocab(spec)
    writer = GGUFWriter(str(path), spec.arch)
    _add_metadata(writer, spec, len(vocab))
    original: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype=F32, heads=None):
        values = rng.standard_normal(shape).astype(np.float32)
        original[hf_name] = values
        stored = values
        if heads is not None and spec.arch == "llama":
            stored = llama_cpp_permute(values, heads)
        if qtype == F32:
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = values
            return
        packed = quantize(stored, qtype)
        writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
        # rows quantize independently, so permuting rows commutes with the round trip
        expected[hf_name] = dequantize(quantize(values, qtype), qtype).reshape(shape)

    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    add("token_embd.weight", "model.embed_tokens.weight", (len(vocab), spec.hidden), Q8_0)
    for i in range(spec.layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        mt = spec.matrix_type
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (spec.hidden,))
        add(
            f"{blk}.attn_q.weight",
            f"{hf}.self_attn.q_proj.weight",
            (q_rows, spec.hidden),
            mt,
            spec.heads,
        )
        add(
            f"{blk}.attn_k.weight",
            f"{hf}.self_attn.k_proj.weight",
            (kv_rows, spec.hidden),
            mt,
            spec.kv_heads,
        )
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, spec.hidden), F16)
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (spec.hidden, q_rows), mt)
        if spec.arch == "qwen2":
            add(f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (q_rows,))
            add(f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv_rows,))
            add(f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv_rows,))
        if spec.arch == "qwen3":
            add(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (spec.head_dim,))
            add(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (spec.head_dim,))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (spec.hidden,))
        add(
            f"{blk}.ffn_gate.weight",
            f"{hf}.mlp.gate_proj.weight",
            (spec.intermediate, spec.hidden),
            mt,
        )
        add(
            f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (spec.intermediate, spec.hidden), mt
        )
        add(
            f"{blk}.ffn_down.weight",
            f"{hf}.mlp.down_proj.weight",
            (spec.hidden, spec.intermediate),
            F32,
        )
    add("output_norm.weight", "model.norm.weight", (spec.hidden,))
    if not spec.tied:
        add("output.weight", "lm_head.weight", (len(vocab), spec.hidden), Q8_0)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path=path, spec=spec, original=original, expected=expected)


def _write_tokenizer_vocab(spec: TinySpec) -> list[str]:
    if spec.tokenizer == "llama":
        return sentencepiece_vocab()[0]
    return byte_level_vocab()[0]


def _add_metadata(writer: GGUFWriter, spec: TinySpec, vocab_size: int) -> None:
    writer.add_name("tiny")
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    for key, value in spec.extra_metadata.items():
        writer.add_string(key, value)
    if spec.tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(spec.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    elif spec.tokenizer == "llama":
        tokens, types, scores = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
