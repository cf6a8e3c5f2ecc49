"""Speculative decoding on hybrid models through verify graphs, on the CPU: the Triton backend
under TRITON_INTERPRET=1 and the graph table with replays emulated eagerly
(worker/eager_graphs.py). Verify steps, and decode steps that fold a verify's accepted run
into the linear states, replay the padded verify graphs (StateRows: every block, count and
slot a device value, and the linear layers read no value back to the host); the tokens are
those of eager speculation and of no speculation."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("triton")

from oracle import write_tiny_checkpoint  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

import shoal.spec_decode.ngram as ngram  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.attention.metadata import GroupedMetadata  # noqa: E402
from shoal.engine.scheduler import Scheduler  # noqa: E402
from shoal.layers.linear_attention import LinearAttention  # noqa: E402
from shoal.worker.model_graphs import ModelGraphs, step_shapes  # noqa: E402

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
K = 2  # drafts per verify: graphs of q = 2 and 3
MAX_TOKENS = (9, 7, 14)
SPEC = {"method": "ngram", "num_speculative_tokens": K, "adaptive_budget": False}


@pytest.fixture(scope="module", params=["qwen3_5_text", "kimi_linear"])
def hybrid(request, tmp_path_factory):
    """Gated DeltaNet beside gated attention; KDA (a decay per key channel) beside MLA."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_linear":
        from models.test_kimi_linear import write_kimi_checkpoint

        return write_kimi_checkpoint(path, seed=3)
    return write_tiny_checkpoint(path, "qwen3_5_text", seed=3, **LINEAR)


def _llm(path, backend: str, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
               num_gpu_blocks_override=32, max_model_len=128, max_num_seqs=4,
               attention_backend=backend, **kw)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 13, 9)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class NoHostReads(TorchFunctionMode):
    """Fails on any read of a tensor's values by the host (what a CUDA graph cannot hold)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
             "nonzero", "masked_select", "unique"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bool_index = name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in self.READS or bool_index:
            raise AssertionError(f"a host read in a verify graph's linear layer: {name}")
        return func(*args, **(kwargs or {}))


def _guard_graph_rows(monkeypatch) -> list[int]:
    """Linear layers run a verify graph's rows under NoHostReads; counts those runs."""
    guarded: list[int] = []
    forward = LinearAttention.forward

    def checked(self, hidden, md):
        rows = (md.of(self.kv_group) if isinstance(md, GroupedMetadata) else md).rows
        if rows is None:
            return forward(self, hidden, md)
        guarded.append(rows.q)
        with NoHostReads():
            return forward(self, hidden, md)

    monkeypatch.setattr(LinearAttention, "forward", checked)
    return guarded


def _scripted_drafts(monkeypatch, truth: dict[tuple[int, ...], list[int]]) -> None:
    """ngram proposes from the known greedy continuation: the first request its next K tokens
    (all accepted), none every third token (its next step folds a replay without verifying);
    the second K wrong tokens (all rejected); the third the truth with its last draft wrong,
    then from its 8th token none."""
    order = list(truth)

    def draft(self, prompt, output) -> list[int]:
        key = tuple(prompt)
        which, n = order.index(key), len(output)
        nxt = truth[key][n:n + K]
        if which == 0:
            return [] if n % 3 == 2 else nxt
        if which == 1:
            return [(t + 1) % 512 for t in nxt]
        if n >= 8:  # alone by then: plain decodes
            return []
        return nxt[:-1] + [(nxt[-1] + 1) % 512]

    monkeypatch.setattr(ngram.NgramDrafter, "draft", draft)


def test_verify_graphs_of_a_hybrid_match_eager_speculation(hybrid, monkeypatch):
    prompts = _prompts()
    plain = _generate(_llm(hybrid, "torch"), prompts)
    _scripted_drafts(monkeypatch, {tuple(p): t for p, t in zip(prompts, plain)})
    verified: list[tuple[int, int]] = []
    settle = Scheduler._settle_verified

    def count(self, req, num_drafts: int, accepted: int) -> None:
        verified.append((num_drafts, accepted))
        settle(self, req, num_drafts, accepted)

    monkeypatch.setattr(Scheduler, "_settle_verified", count)
    eager = _generate(_llm(hybrid, "torch", speculative_config=SPEC), prompts)
    assert eager == plain
    assert (K, 0) in verified and (K, K) in verified  # all rejected, all accepted

    llm = _llm(hybrid, "triton", speculative_config=SPEC)
    runner = llm.llm_engine.core.runner
    # (each capture is an interpreted forward: only the shapes these requests replay)
    shapes = [s for s in step_shapes(4, 64, prefill=False, num_speculative_tokens=K)
              if s.rows == 1 or (s.rows == 4 and s.q > 1)]
    graphs = ModelGraphs(runner.model, runner.backend, shapes, 128 // runner.block_size,
                         runner.device, block_size=runner.block_size,
                         table_type=EagerGraphTable, windows=runner.forwarder.windows,
                         group_backends=runner.graph_group_backends())
    graphs.capture()
    runner.graphs = runner.forwarder.graphs = graphs
    runs, eager_steps, longest = [], [], []
    real_run, real_eager = graphs.run, runner.forwarder._eager

    def run(shape, inp, fill, **kw):
        runs.append((shape, len(inp.items), inp.has_drafts, any(it.replay for it in inp.items)))
        longest.append(max(inp.query_lens()))
        return real_run(shape, inp, fill, **kw)

    def eager_step(inp):
        eager_steps.append((inp.has_drafts, any(it.replay for it in inp.items)))
        return real_eager(inp)

    graphs.run, runner.forwarder._eager = run, eager_step
    guarded = _guard_graph_rows(monkeypatch)
    verified.clear()
    got = _generate(llm, prompts)
    assert got == plain
    assert (K, 0) in verified and (K, K) in verified
    # Every verify and every replay ran in a graph; only prefills ran eagerly.
    assert eager_steps and not any(d or r for d, r in eager_steps)
    verifies = [(s, n) for s, n, drafts, _ in runs if drafts]
    assert any(s.rows > n for s, n in verifies)  # three requests padded to four rows
    # a step replays the fewest tokens that fit its longest request (graphs of q = 2 and 3)
    assert all(s.q == max(2, q) for (s, *_), q in zip(runs, longest) if s.q > 1)
    assert {s.q for s, *_ in runs} == {1, 2, 3}
    # decodes folding a replay ran in a verify graph (q = 2); plain decodes in decode graphs
    assert any(s.q == 2 and not d and r for s, _, d, r in runs)
    assert any(s.q == 1 for s, *_ in runs)
    assert guarded  # the linear layers' verify rows read nothing back to the host
    assert runner.forwarder.replay_slots.held == 0  # finished requests gave theirs back
    # padding rows wrote the trash block, never the null block
    layer = runner.model.attention_layers()[0]
    conv, state = layer.pages.read(torch.tensor([runner.null_block]))
    assert not state.any() and not conv.any()
