"""Method "mtp" on DeepSeek-V4 (shoal/models/deepseek_v4_mtp.py), fp32, on a tiny random
checkpoint built with transformers 5.25: a sliding, a CSA (m = 4, indexer top-4) and an HCA
(m' = 16) layer with a window of 8 and 3 hyper-connection streams, num_nextn_predict_layers=1,
and the MTP layer written as DeepSeek's release stores it (mtp.0.*: e_proj, h_proj, enorm,
hnorm, norm, hc_head_*, and a V4 block in the main layers' spelling).

transformers builds no MTP layer, so the oracle is the MTP formula in plain torch from the
checkpoint's tensors around transformers' own decoder layer (a 4-layer model whose last layer
is the MTP block), read over transformers' target streams. The weights make the target and
the MTP layer nearly a bigram model (the blocks' outputs scaled down), so some drafts are
accepted (about 1 in 4) and most are not: verify steps close compressed groups with tokens
that are then rejected and recomputed. The main blocks still move the logprobs, which the
speculative run must match to 1e-5 (a 0.1% error in the entries of verify steps shows)."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_decode.proposal_log import record_proposals
from spec_decode.test_spec_engine import SpecCounter
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams

N = 3  # main layers; the MTP block is layer N of the 4-layer model the checkpoint comes from
W, K, EPS = 8, 2, 1e-5
V4 = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=N + 1,
          num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
          partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=8,
          n_shared_experts=1, compress_rates={"compressed_sparse_attention": 4,
                                              "heavily_compressed_attention": 16},
          layer_types=["sliding_attention", "compressed_sparse_attention",
                       "heavily_compressed_attention", "sliding_attention"],
          mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3, sliding_window=W,
          o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=32, index_topk=4,
          max_position_embeddings=512, rms_norm_eps=EPS, bos_token_id=1, eos_token_id=2,
          num_nextn_predict_layers=1)
# the blocks' outputs into the residual streams
_OUTPUTS = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_b_proj\.weight|"
                      r"mlp\.experts\.down_proj|mlp\.shared_experts\.down_proj\.weight)$")


def _rms(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x if w is None else x * w


def _random_4_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v4", **V4),
                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            m = _OUTPUTS.match(name)
            if m:  # near-bigram: the blocks add little to the residual streams
                p.mul_(0.02 if int(m[1]) < N else 0.01)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    return hf


class Reference:
    """transformers' 3-layer target (its last streams) and the MTP formula in plain torch."""

    def __init__(self, full: torch.nn.Module, own: dict[str, torch.Tensor]):
        cfg = AutoConfig.for_model("deepseek_v4", **dict(
            V4, num_hidden_layers=N, layer_types=V4["layer_types"][:N],
            mlp_layer_types=V4["mlp_layer_types"][:N]))
        self.target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        state = {k: v for k, v in full.state_dict().items() if f"layers.{N}." not in k}
        missing, unexpected = self.target.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in k for k in missing), missing
        self.full, self.block, self.w = full, full.model.layers[N], own
        self._streams: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def streams(self, seq: list[int]) -> torch.Tensor:
        """The target's last-layer streams [T, hc, D] (before its collapse and norm)."""
        if tuple(seq) not in self._streams:
            out = {}
            hook = self.target.model.layers[-1].register_forward_hook(
                lambda _m, _a, y: out.setdefault("s", y))
            self.target(torch.tensor([seq]), use_cache=False)
            hook.remove()
            self._streams[tuple(seq)] = out["s"][0]
        return self._streams[tuple(seq)]

    @torch.no_grad()
    def mtp(self, next_ids: list[int], prev: torch.Tensor, w: dict | None = None,
            block: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions 0..T-1 (causal, window W): (output streams, logits). w, block:
        an MTP layer's own tensors and block (the first's by default)."""
        w, t = self.w if w is None else w, len(next_ids)
        block = self.block if block is None else block
        e = _rms(self.full.model.embed_tokens(torch.tensor(next_ids)), w["enorm.weight"])
        x = _rms(prev, w["hnorm.weight"]) @ w["h_proj.weight"].T
        x = (x + (e @ w["e_proj.weight"].T)[:, None])[None]
        pos = torch.arange(t)[None]
        gap = pos[0][:, None] - pos[0][None]
        mask = torch.zeros(t, t).masked_fill((gap < 0) | (gap >= W), float("-inf"))
        rope = {k: self.full.model.rotary_emb(x, pos, layer_type=k) for k in ("main", "compress")}
        y = block(x, input_ids=torch.tensor([next_ids]), position_embeddings=rope,
                       position_ids=pos, attention_mask=mask[None, None])[0]
        mixes = F.linear(_rms(y.flatten(1)), w["hc_head_fn"])
        pre = torch.sigmoid(mixes * w["hc_head_scale"] + w["hc_head_base"]) + 1e-6
        h = (pre[..., None] * y).sum(1)
        return y, _rms(h, w["norm.weight"]) @ self.full.lm_head.weight.T

    def chain_drafts(self, seq: list[int], layers: list[tuple[dict, torch.nn.Module]]
                     ) -> list[int]:
        """Drafts 1..len(layers) of the sequential chain after `seq`: MTP layer j's row at p
        reads layer j - 1's output streams at p (layer 0: the target's) and the token at
        p + j + 1 (the last one: draft j)."""
        ids, prev, out = list(seq[1:]), self.streams(seq)[:-1], []
        for w, block in layers:
            prev, logits = self.mtp(ids, prev, w, block)
            out.append(int(logits[-1].argmax()))
            ids = ids[1:] + [out[-1]]
        return out

    def drafts(self, seq: list[int], k: int) -> list[int]:
        """Greedy MTP drafts after `seq`, recomputed from scratch."""
        ids, prev, out = list(seq[1:]), self.streams(seq)[:-1], []
        for _ in range(k):
            y, logits = self.mtp(ids, prev)
            out.append(int(logits[-1].argmax()))
            ids.append(out[-1])
            prev = torch.cat([prev, y[-1:]])
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4-mtp")
    full = _random_4_layers()
    full.save_pretrained(root / "full", safe_serialization=True)
    saved = load_file(root / "full" / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    h, hc = V4["hidden_size"], V4["hc_mult"]
    own = {"e_proj.weight": torch.eye(h) + 0.005 * torch.randn(h, h, generator=gen),
           "h_proj.weight": 0.01 * torch.randn(h, h, generator=gen),
           "enorm.weight": torch.ones(h), "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
           "norm.weight": saved["model.norm.weight"].clone(),
           "hc_head_fn": 0.2 * torch.randn(hc, hc * h, generator=gen),
           "hc_head_base": torch.rand(hc, generator=gen), "hc_head_scale": torch.ones(1)}
    tensors = {}
    for name, t in saved.items():
        if name.startswith(f"model.layers.{N}."):  # the MTP block, as the release spells it
            tensors["mtp.0." + name.removeprefix(f"model.layers.{N}.")] = t
        else:
            tensors[name] = t
    tensors.update({"mtp.0." + k: v for k, v in own.items()})
    target = root / "target"
    target.mkdir()
    save_file(tensors, target / "model.safetensors")
    cfg = json.loads((root / "full" / "config.json").read_text())
    cfg.update(num_hidden_layers=N, layer_types=cfg["layer_types"][:N],
               mlp_layer_types=cfg["mlp_layer_types"][:N])
    (target / "config.json").write_text(json.dumps(cfg))
    return target, Reference(full, own)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, max_model_len=256,
               num_gpu_blocks_override=256, **kw)


def _tokens_and_logprobs(outs) -> tuple[list[list[int]], list[list[float]]]:
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t].logprob for t, lp in zip(i, o.outputs[0].logprobs)] for i, o in zip(ids, outs)]
    return ids, lps


def test_mtp_is_lossless_and_drafts_the_mtp_formula(ckpt):
    """Greedy tokens (and their logprobs) with k=2 MTP drafts are those without; every
    proposal is the formula's."""
    target, ref = ckpt
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (141, 23, 6)]
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain, plain_lp = _tokens_and_logprobs(_llm(target).generate(inputs, sp, use_tqdm=False))
    llm = _llm(target, max_num_batched_tokens=48,
               speculative_config={"method": "mtp", "num_speculative_tokens": K})
    counter, log = SpecCounter(llm), record_proposals(llm)
    spec, spec_lp = _tokens_and_logprobs(llm.generate(inputs, sp, use_tqdm=False))
    assert spec == plain
    # the main blocks' outputs are small: their logprobs show a stale compressed entry
    torch.testing.assert_close(spec_lp, plain_lp, atol=1e-5, rtol=0)
    # drafts were both accepted and rejected (verify steps rewrite compressed groups)
    assert 0 < counter.accepted < counter.draft_tokens
    assert len(log) > 10
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), len(seq)
    # with async scheduling (the next step launched before this one's streams are mirrored)
    pipelined = _llm(target, max_num_batched_tokens=48, async_scheduling=True,
                     speculative_config={"method": "mtp", "num_speculative_tokens": K})
    assert _tokens_and_logprobs(pipelined.generate(inputs, sp, use_tqdm=False))[0] == plain


def test_head_matches_the_formula_past_the_window(ckpt):
    """One pass of the head over 21 fresh rows (longer than the window): output streams and
    logits against the plain evaluation, to 1e-4."""
    target, ref = ckpt
    llm = _llm(target, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    mtp = llm.llm_engine.core.runner.drafter
    seq = [random.Random(3).randrange(3, 512) for _ in range(22)]
    streams = ref.streams(seq)
    want_y, want_logits = ref.mtp(seq[1:], streams[:-1])
    t = len(seq) - 1
    md = mtp._metadata([t], [0], [list(range(-(-t // 4)))], 0)
    with torch.inference_mode():
        y = mtp.model(torch.tensor(seq[1:]), torch.arange(t), streams[:-1].flatten(1), md)
        logits = mtp.model.compute_logits(y)
    torch.testing.assert_close(y, want_y.flatten(1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def two_layers(ckpt, tmp_path_factory):
    """The checkpoint with num_nextn_predict_layers=2: mtp.1.* is mtp.0.*, but for its own
    h_proj, hnorm, e_proj and its block's attention norm (so a depth that read the other's
    weights would draft otherwise). Returns (folder, reference, each layer's (own tensors,
    transformers block))."""
    target, ref = ckpt
    tensors = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    h = V4["hidden_size"]
    own = dict(ref.w, **{"h_proj.weight": 0.01 * torch.randn(h, h, generator=gen),
                         "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
                         "e_proj.weight": torch.eye(h) + 0.005 * torch.randn(h, h,
                                                                             generator=gen)})
    block = copy.deepcopy(ref.block)
    with torch.no_grad():
        block.input_layernorm.weight.mul_(1.5)
    for name, t in list(tensors.items()):
        if name.startswith("mtp.0."):
            rest = name.removeprefix("mtp.0.")
            tensors["mtp.1." + rest] = own.get(rest, t).clone()
    tensors["mtp.1.attn_norm.weight"] = block.input_layernorm.weight.detach().clone()
    folder = tmp_path_factory.mktemp("dsv4-mtp2")
    save_file(tensors, folder / "model.safetensors")
    cfg = json.loads((target / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=2)))
    return folder, ref, [(ref.w, ref.block), (own, block)]


def test_two_mtp_layers_chain_losslessly(two_layers):
    """Two MTP layers, k=2: draft 2 is the second layer's, over its own window cache, from
    the first's output streams (every proposal is the chain's formula); greedy tokens and
    logprobs are the plain engine's; drafts at both positions are accepted and rejected."""
    folder, ref, layers = two_layers
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (70, 9)]
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain, plain_lp = _tokens_and_logprobs(_llm(folder).generate(inputs, sp, use_tqdm=False))
    llm = _llm(folder, max_num_batched_tokens=48,
               speculative_config={"method": "mtp", "num_speculative_tokens": K})
    drafter = llm.llm_engine.core.runner.drafter
    assert drafter.depths == 2 and len(drafter.model.layers) == 2
    per_pos = [0, 0]
    stats = llm.llm_engine.core.scheduler.stats

    def counting():
        s = stats()
        for i, n in enumerate(s.spec_num_accepted_tokens_per_pos or []):
            per_pos[i] += n
        return s
    llm.llm_engine.core.scheduler.stats = counting
    counter, log = SpecCounter(llm), record_proposals(llm)
    spec, spec_lp = _tokens_and_logprobs(llm.generate(inputs, sp, use_tqdm=False))
    assert spec == plain
    torch.testing.assert_close(spec_lp, plain_lp, atol=1e-5, rtol=0)
    assert counter.draft_tokens == K * counter.drafts
    assert sum(per_pos) == counter.accepted < counter.draft_tokens
    assert per_pos[0] >= per_pos[1] > 0  # the second layer's drafts are accepted too
    assert len(log) > 8
    for seq, drafts in log:
        assert drafts == ref.chain_drafts(seq, layers[:len(drafts)]), len(seq)


def test_a_compressed_mtp_layer_is_refused(ckpt, tmp_path):
    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM
    from shoal.models.deepseek_v4_mtp import DeepseekV4MTP

    target, _ = ckpt
    tensors = load_file(target / "model.safetensors")
    cfg = AutoConfig.from_pretrained(target)
    head, main = DeepseekV4MTP(cfg, torch.float32), DeepseekV4ForCausalLM(cfg, torch.float32)
    extra = [("mtp.0.attn.compressor.wkv.weight", torch.zeros(64, 64))]
    with pytest.raises(ValueError, match="compressed .* window-only"):
        head.load_weights(list(tensors.items()) + extra, main)


def test_mtp_on_two_tensor_parallel_ranks(ckpt):
    """tensor_parallel_size=2: the MTP block's heads and experts split like the target's;
    greedy tokens and logprobs are the one-rank plain engine's (a 141-token prompt: CSA and
    HCA groups close in verify steps) and drafts are accepted."""
    target, _ = ckpt
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (141, 9)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain, plain_lp = _tokens_and_logprobs(_llm(target).generate(inputs, sp, use_tqdm=False))
    llm = _llm(target, tensor_parallel_size=2, max_num_batched_tokens=48,
               speculative_config={"method": "mtp", "num_speculative_tokens": K})
    try:
        head = llm.llm_engine.core.runner.driver.drafter.model
        assert head.mtp_block.self_attn.num_heads == V4["num_attention_heads"] // 2
        counter = SpecCounter(llm)
        spec, spec_lp = _tokens_and_logprobs(llm.generate(inputs, sp, use_tqdm=False))
        assert spec == plain
        torch.testing.assert_close(spec_lp, plain_lp, atol=1e-5, rtol=0)
        assert 0 < counter.accepted < counter.draft_tokens
    finally:
        llm.shutdown()
