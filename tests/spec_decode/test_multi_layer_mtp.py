"""Multi-layer MTP (shoal/spec_decode/mtp_chain.py) on tiny random DeepSeek-V3 and Qwen3-Next
checkpoints with three MTP layers: greedy output is the plain engine's (one rank and two
tensor-parallel gloo ranks), and every proposal is what a plain torch evaluation of the
sequential MTP predicts (depth j at position p reads depth j - 1's output at p and the token
at p + j + 1; drafts past the layers: the last layer goes on alone), written here from the
checkpoint's tensors (each depth's decoder layer is transformers' layer of the same
weights)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from deepseek_tiny import V3, write_deepseek
from engine_helpers import random_prompts, tiny_llm
from oracle import TINY_COMMON, write_tiny_checkpoint
from safetensors.torch import load_file, save_file
from spec_decode.proposal_log import record_proposals
from spec_decode.test_spec_engine import SpecCounter
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import SamplingParams

N = V3["num_hidden_layers"]  # the main layers; MTP layer j is model.layers.{N + j}
DEPTHS = 3
EPS = V3["rms_norm_eps"]


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _layer(model, j: int, x: torch.Tensor) -> torch.Tensor:
    """Decoder layer j of a transformers model over x [T, H] at positions 0..T-1 (causal)."""
    t = x.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    y = model.layers[j](x[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=model.rotary_emb(x[None], pos))
    return (y[0] if isinstance(y, tuple) else y)[0]


class ChainReference:
    """The target (transformers) and the MTP chain in plain torch: depth() is a family's."""

    def __init__(self, hf):
        self.hf = hf

    @torch.no_grad()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden state of every position."""
        return self.hf.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]

    def depth(self, j: int, ids: list[int], prev: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer j over positions 0..T-1: (output states, logits)."""
        raise NotImplementedError

    def drafts(self, seq: list[int], k: int) -> list[int]:
        return self.drafts_and_probs(seq, k)[0]

    def drafts_and_probs(self, seq: list[int], k: int) -> tuple[list[int], list[float]]:
        """k greedy drafts after `seq` from scratch, and the head's probability of each:
        depths 0..min(k, DEPTHS) - 1 in turn over positions 0..L-2, then the last depth on
        its own outputs."""
        s, prev, out, probs = list(seq), self.hidden(seq)[:-1], [], []

        def pick(logits: torch.Tensor) -> None:
            out.append(int(logits[-1].argmax()))
            probs.append(float(torch.softmax(logits[-1], -1).max()))
        t, m = len(seq) - 1, min(k, DEPTHS)
        for j in range(m):
            below = prev
            ids = s[j + 1:j + 1 + t]  # the token j positions past depth 0's
            prev, logits = self.depth(j, ids, below)
            pick(logits)
            s.append(out[-1])
        y = prev
        for _ in range(k - m):  # a row at the next position: the last draft, the last state
            ids.append(out[-1])
            below = torch.cat([below, y[-1:]])
            y, logits = self.depth(m - 1, ids, below)
            pick(logits)
        return out, probs


class DeepseekReference(ChainReference):
    """DeepSeek-V3: depth j is model.layers.{N + j} (transformers' decoder layer of the
    checkpoint) with its own enorm, hnorm, eh_proj and shared head."""

    def __init__(self, hf, extra: dict[str, torch.Tensor]):
        super().__init__(hf)
        hf.config.num_hidden_layers = N  # the main model runs its first N layers only
        self.w = [{k.split(f"layers.{N + j}.", 1)[1]: v for k, v in extra.items()
                   if k.startswith(f"model.layers.{N + j}.")} for j in range(DEPTHS)]

    @torch.no_grad()
    def depth(self, j, ids, prev):
        w = self.w[j]
        emb = self.hf.model.embed_tokens(torch.tensor(ids)).clone()
        emb[0] = 0  # position 0's embedding is masked (as vLLM does)
        x = torch.cat([_rms(emb, w["enorm.weight"]), _rms(prev, w["hnorm.weight"])], -1)
        y = _layer(self.hf.model, N + j, x @ w["eh_proj.weight"].T)
        return y, _rms(y, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T


def _extra(seed: int, weights: dict[str, torch.Tensor], exact: set[int]
           ) -> dict[str, torch.Tensor]:
    """Each depth's own tensors: random, or for the depths in `exact` the bigram's (the
    token's embedding through eh_proj, the target's norm and head)."""
    h, v = V3["hidden_size"], V3["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    extra = {}
    for j in range(DEPTHS):
        p = f"model.layers.{N + j}."
        extra |= {p + "enorm.weight": 0.5 + torch.rand(h, generator=gen),
                  p + "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
                  p + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=gen),
                  p + "shared_head.norm.weight": 0.5 + torch.rand(h, generator=gen),
                  p + "shared_head.head.weight": 0.2 * torch.randn(v, h, generator=gen)}
        if j in exact:
            extra[p + "enorm.weight"] = torch.ones(h)
            extra[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
            extra[p + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
            extra[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    return extra


def _save(folder, cfg: dict, weights: dict[str, torch.Tensor], **fields):
    folder.mkdir()
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(dict(cfg, **fields)))
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (target folder with three MTP layers, DeepseekReference). "random": every depth
    random (drafts mostly rejected at once). "bigram": the main layers add nothing (the next
    token is a function of the current one), depths 0 and 1 are that function of their
    token plus a small attention / MoE term, depth 2 random: drafts 1 and 2 mostly accepted,
    draft 3 mostly not (rejections partway)."""
    root = tmp_path_factory.mktemp("mtp-chain")
    full, hf = write_deepseek(root / "full", "deepseek_v3", seed=3,
                              **dict(V3, num_hidden_layers=N + DEPTHS))
    cfg = json.loads((full / "config.json").read_text())
    weights = load_file(full / "model.safetensors")
    extra = _extra(11, weights, set())
    out = {"random": (_save(root / "random", cfg, {**weights, **extra}, num_hidden_layers=N,
                            num_nextn_predict_layers=DEPTHS), DeepseekReference(hf, extra))}
    bigram = dict(weights)
    for name, t in weights.items():
        m = re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\..*down_proj)\.weight$",
                     name)
        if m:
            bigram[name] = t * (0.0 if int(m[1]) < N else 0.02)
    hf_b = AutoModelForCausalLM.from_pretrained(_save(root / "bigram-full", cfg, bigram),
                                                dtype=torch.float32).eval()
    extra_b = _extra(12, bigram, {0, 1})
    out["bigram"] = (_save(root / "bigram", cfg, {**bigram, **extra_b}, num_hidden_layers=N,
                           num_nextn_predict_layers=DEPTHS), DeepseekReference(hf_b, extra_b))
    return out


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _accepted(seq: list[int], drafts: list[int], prompts, want) -> int:
    """How many of a proposal's drafts the greedy output goes on with."""
    for p, w in zip(prompts, want):
        full = p["prompt_token_ids"] + w
        if full[:len(seq)] == seq:
            rest = full[len(seq):]
            return next((i for i, (d, t) in enumerate(zip(drafts, rest)) if d != t),
                        min(len(drafts), len(rest)))
    raise AssertionError(f"a proposal after {seq}, a sequence no request had")


def _record_probs(llm) -> dict[tuple[int, ...], list[float]]:
    """The drafter's probabilities of each proposal (confidence-scheduled verification), by
    the sequence it followed."""
    drafter = llm.llm_engine.core.runner.drafter
    probs: dict[tuple[int, ...], list[float]] = {}
    inner = drafter.mirror_and_propose

    def recording(reqs, hidden, failed, propose=True):
        drafts = inner(reqs, hidden, failed, propose=propose)
        probs.update((tuple(r.state.all_token_ids()), drafter.last_draft_probs[r.serial])
                     for r in reqs if r.serial in drafts)
        return drafts
    drafter.mirror_and_propose = recording
    return probs


@pytest.mark.parametrize("name,k,async_scheduling", [
    ("bigram", 3, False),  # the three layers
    ("random", 5, True),   # drafts 4 and 5: the last layer on its own; their probabilities
])
def test_chain_drafts_the_formula_and_is_lossless(ckpts, name, k, async_scheduling):
    target, ref = ckpts[name]
    confidence = name == "random"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(3, seed=8, lo=2, hi=30)
    # Chunked prefills (16 tokens a step), blocks of 4, every draft verified.
    kw = dict(max_num_batched_tokens=16)
    want = _ids(tiny_llm(target, **kw).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(target, async_scheduling=async_scheduling, **kw,
                   speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                       "adaptive_budget": False,
                                       "confidence_threshold": 0.0 if confidence else None})
    drafter = llm.llm_engine.core.runner.drafter
    assert drafter.depths == min(k, DEPTHS)
    caches = [layer.kv_cache for layer in drafter.kv_layers()]  # one cache per layer
    assert len({c.data_ptr() for c in caches}) == len(caches) == drafter.depths
    counter = SpecCounter(llm)
    probs = _record_probs(llm) if confidence else None
    log = record_proposals(llm)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert len(log) > 10
    for seq, drafts in log:
        want_drafts, want_probs = ref.drafts_and_probs(seq, len(drafts))
        assert drafts == want_drafts, seq
        if probs is not None:
            assert probs[tuple(seq)] == pytest.approx(want_probs, abs=1e-4)
    assert 0 < counter.drafts and counter.accepted <= counter.draft_tokens
    accepted = [_accepted(seq, drafts, prompts, want) for seq, drafts in log]
    if name == "bigram":  # proposals accepted in part: rejected after accepted drafts
        assert sum(0 < a < k for a in accepted) >= 3 and max(accepted) >= 2
    # A prefix-cache hit on all but one token: the first mirror runs depth 0 alone (no
    # carry; the chain starts its deeper layers later). Still lossless.
    full = prompts[0]["prompt_token_ids"] + want[0]
    cut = (len(full) - 3) // 4 * 4 + 1  # blocks of 4 cached, one token past them
    again = SamplingParams(temperature=0, max_tokens=len(full) - cut, ignore_eos=True)
    assert _ids(llm.generate([{"prompt_token_ids": full[:cut]}], again,
                             use_tqdm=False)) == [full[cut:]]


def test_two_ranks_draft_as_one_rank(ckpts):
    """Two tensor-parallel gloo ranks (the mp executor): the plain engine's tokens, and
    every proposal of rank 0 is the formula's (three layers, then one step past them)."""
    torch.set_num_threads(1)
    target, ref = ckpts["bigram"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(2, seed=5, lo=4, hi=20)
    want = _ids(tiny_llm(target).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(target, tensor_parallel_size=2,
                   speculative_config={"method": "mtp", "num_speculative_tokens": DEPTHS + 1,
                                       "adaptive_budget": False})
    try:
        runner = llm.llm_engine.core.runner
        assert type(runner).__name__ == "MultiprocExecutor" and runner.world == 2
        drafter = runner.driver.drafter
        log: list[tuple[list[int], list[int]]] = []
        inner = drafter.mirror_and_propose

        def recording(reqs, hidden, failed, propose=True):
            drafts = inner(reqs, hidden, failed, propose=propose)
            log.extend((r.state.all_token_ids(), drafts[r.serial]) for r in reqs
                       if r.serial in drafts)
            return drafts
        drafter.mirror_and_propose = recording
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    finally:
        llm.shutdown()
    assert len(log) > 4
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert max(_accepted(seq, d, prompts, want) for seq, d in log) >= 2


# Qwen3-Next: three linear-attention layers and a full one; MTP layers of the MoE kind.
QWEN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, norm_topk_prob=True)


def _offset_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _rms(x, 1.0 + w)


class QwenReference(ChainReference):
    """Qwen3-Next: depth j is mtp.layers.j (here transformers' decoder layer j of `layers`,
    a model of those tensors) between the shared fc and norms, on the target's embedding and
    head."""

    def __init__(self, hf, layers, w: dict[str, torch.Tensor]):
        super().__init__(hf)
        self.layers, self.w = layers, w

    @torch.no_grad()
    def depth(self, j, ids, prev):
        w = self.w
        emb = self.hf.model.embed_tokens(torch.tensor(ids))
        x = torch.cat([_offset_rms(emb, w["mtp.pre_fc_norm_embedding.weight"]),
                       _offset_rms(prev, w["mtp.pre_fc_norm_hidden.weight"])], -1)
        y = _offset_rms(_layer(self.layers.model, j, x @ w["mtp.fc.weight"].T),
                        w["mtp.norm.weight"])
        return y, self.hf.lm_head(y)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    """A tiny random Qwen3-Next target with three MTP layers (mtp.layers.0..2, one fc and
    the norms shared), and its QwenReference."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen-chain") / "t", "qwen3_next",
                                 seed=1, **QWEN, mlp_only_layers=[1])
    layers = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **{
        **TINY_COMMON, **QWEN, "num_hidden_layers": DEPTHS, "mlp_only_layers": [],
        "layer_types": ["full_attention"] * DEPTHS}), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in layers.parameters():
            t.copy_(0.2 * torch.randn(t.shape, generator=gen) if t.dim() > 1
                    else 0.5 + torch.rand(t.shape, generator=gen))
    h = TINY_COMMON["hidden_size"]
    w = {"mtp.fc.weight": 0.2 * torch.randn(h, 2 * h, generator=gen)}
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        w[f"mtp.{norm}.weight"] = 0.5 * torch.rand(h, generator=gen)
    tensors = load_file(path / "model.safetensors") | w | {
        "mtp." + n[len("model."):]: t.contiguous() for n, t in layers.state_dict().items()
        if n.startswith("model.layers.")}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": DEPTHS}))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, QwenReference(hf, layers, w)


def test_qwen3_next_chain_drafts_the_formula(qwen_ckpt):
    """Two of the three layers (num_speculative_tokens 2: the third is neither built nor
    loaded): lossless, every proposal the formula's."""
    target, ref = qwen_ckpt
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(3, seed=4, lo=2, hi=30)
    kw = dict(max_num_batched_tokens=64, num_gpu_blocks_override=64, max_model_len=512,
              enable_prefix_caching=False)
    want = _ids(tiny_llm(target, **kw).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(target, **kw, speculative_config={"method": "mtp",
                                                      "num_speculative_tokens": 2})
    head = llm.llm_engine.core.runner.drafter.model
    assert head.num_depths == 2 and len(head.attention_layers()) == 2
    log = record_proposals(llm)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert len(log) > 10
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_drafts_past_the_layers_replay_the_draft_graphs(ckpts, caplog):
    """The Triton backend (interpreted) with the draft graphs emulated (as
    test_draft_graphs_cpu.py): the chain's several-token queries run eagerly, the step past
    the three layers replays the graphs of the last layer; every proposal the formula's."""
    pytest.importorskip("triton")
    from spec_decode.test_draft_graphs_cpu import MAX_BLOCKS, MAX_LEN, EagerDraftGraphs

    target, ref = ckpts["random"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(3, seed=9, lo=2, hi=14)
    want = _ids(tiny_llm(target).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(target, attention_backend="triton", max_num_seqs=4, max_model_len=MAX_LEN,
                   speculative_config={"method": "mtp", "num_speculative_tokens": DEPTHS + 1})
    drafter = llm.llm_engine.core.runner.drafter
    with caplog.at_level("INFO", logger="shoal.spec_decode.mtp"):
        drafter.capture_graphs(None, MAX_BLOCKS, EagerDraftGraphs)
    assert "run MTP layers 2..3 eagerly" in caplog.text
    log = record_proposals(llm)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    runs = drafter.graphs.runs
    # (proposals past the layers: those the draft limits let go deeper than DEPTHS)
    assert (3, 4, 1) in runs and sum(n for n, _, _ in runs) == sum(
        len(d) > DEPTHS for _, d in log) > 1
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
