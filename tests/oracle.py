"""Test helpers: tiny random checkpoints and a plain transformers greedy decoder (the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def write_tiny_checkpoint(path: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A Hugging Face folder (config.json + model.safetensors) with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY_COMMON, **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 16)
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def randomize_weights(model: torch.nn.Module) -> None:
    """Weights larger than the default init, so outputs are not flat; linear attention's
    decay rates ~1 per head (A_log) and dt_bias ~-3 (softplus ~0.05): a memory of tens of
    tokens rather than of one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.normal_(0, 0.3)
            elif name.endswith("dt_bias"):
                p.uniform_(-4, -2)
            else:
                p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)


def draft_continuations(monkeypatch, refs: dict[tuple[int, ...], list[int]], k: int = 3,
                        seed: int = 0) -> None:
    """ngram's drafter proposes transformers' own continuation (refs: prompt -> greedy
    tokens), one step in two with a wrong token among its k drafts: verify steps then
    accept some drafts and reject others."""
    import random

    import shoal.spec_decode.ngram as ngram

    rng = random.Random(seed)

    def draft(self, prompt, output) -> list[int]:
        drafts = list(refs[tuple(prompt)][len(output):len(output) + k])
        if drafts and rng.random() < 0.5:
            drafts[rng.randrange(len(drafts))] = 7
        return drafts

    monkeypatch.setattr(ngram.NgramDrafter, "draft", draft)


def record_replay_widths(monkeypatch) -> list[tuple[int, int]]:
    """(values of a verified token's inputs, the row width the layer keeps) of every verify
    the linear-attention layers keep for its replay: what the runner reserves memory for
    (replay_width per token) must be what they keep."""
    from shoal.layers.linear_replays import KeptInputs

    seen: list[tuple[int, int]] = []
    pack = KeptInputs.pack

    def recording(self, x, rest):
        lead = x.shape[:-1]
        seen.append((x.shape[-1] + sum(r.reshape(*lead, -1).shape[-1] for r in rest),
                     self.buffer.shape[-1]))
        return pack(self, x, rest)

    monkeypatch.setattr(KeptInputs, "pack", recording)
    return seen


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding with transformers (no eos handling): tokens and each step's logits."""
    ids = torch.tensor([prompt_ids])
    out, logits = [], []
    past = None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            last = res.logits[0, -1].float()
            logits.append(last)
            tok = int(last.argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out, logits


def greedy_with_logprobs(llm, prompts: list[list[int]], steps: int) -> list:
    """shoal's greedy outputs of token-id prompts, with each chosen token's logprob: what
    check_against_hf compares."""
    from shoal import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_against_hf(outs, prompts, hf, steps: int, *, tol: float = 1e-4,
                     greedy=None) -> None:
    """shoal's greedy outputs (with logprobs=1) against transformers' greedy decoding (or
    `greedy(hf, prompt, steps)`): the same tokens and each chosen token's logprob within
    tol."""
    greedy = greedy or hf_greedy
    for p, o in zip(prompts, outs):
        ref, ref_logits = greedy(hf, p, steps)
        got = o.outputs[0]
        assert got.token_ids == ref
        for i, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[i][tok].logprob == pytest.approx(want, abs=tol)
