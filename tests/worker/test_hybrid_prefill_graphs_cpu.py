"""Lone prompts of hybrid models through the padded prefill graphs, on the CPU: the Triton
backend under TRITON_INTERPRET=1 and the graph table with replays emulated eagerly
(worker/eager_graphs.py). A prompt shorter than its graph's q, one whose chunk crosses a
block end (a fixed-shape save of the state there, for the prefix cache), a prefix hit's
tail and the decodes after them give the eager engine's tokens and logprobs (the eager engine
on the torch backend: an independent reference, where one on Triton's interpreted kernels
would add half again to this test), and the linear
layers of a graph's chunk read no value back to the host; a chunk that starts inside a
block (prefix caching on) and a prompt asking for prompt logprobs run eagerly."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from oracle import write_tiny_checkpoint  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402
from worker.test_hybrid_verify_graphs_cpu import NoHostReads  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.attention.linear_state import StateGraphBuffers  # noqa: E402
from shoal.attention.metadata import GroupedMetadata  # noqa: E402
from shoal.layers.linear_attention import LinearAttention  # noqa: E402
from shoal.worker.graph_table import StepShape  # noqa: E402
from shoal.worker.model_graphs import ModelGraphs  # noqa: E402

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)
BUDGET = 100  # tokens a step: a 110-token prompt's second chunk starts inside a block
SHAPES = [StepShape(1, 1), StepShape(1, 16), StepShape(1, 32), StepShape(1, 128)]


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "kimi_linear"])
def hybrid(request, tmp_path_factory):
    """Gated DeltaNet beside gated attention (dense, MoE); KDA beside MLA."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_linear":
        from models.test_kimi_linear import write_kimi_checkpoint

        return write_kimi_checkpoint(path, seed=3)
    extra = MOE if request.param == "qwen3_next" else {}
    return write_tiny_checkpoint(path, request.param, seed=3, **LINEAR, **extra)


def _llm(path, backend: str = "triton") -> LLM:
    return LLM(model=str(path), dtype="float32", max_num_batched_tokens=BUDGET,
               num_gpu_blocks_override=32, max_model_len=320, max_num_seqs=2,
               attention_backend=backend)


def _prompts(block_size: int) -> list[list[int]]:
    """A prompt crossing a block end, one sharing its first block (a prefix hit, then a tail
    of 20 tokens), a short one and one of 110 tokens (chunks of 100 and 10)."""
    rng = random.Random(7)
    first = [rng.randrange(3, 512) for _ in range(block_size + 20)]
    tail = [rng.randrange(3, 512) for _ in range(20)]
    return [first, first[:block_size] + tail, first[:11],
            [rng.randrange(3, 512) for _ in range(110)]]


def _generate(llm: LLM, prompts, **kw) -> list:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, **kw)
    return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
            for p in prompts]  # one at a time: each prefill is a lone chunk


def _same(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.keys() == b.keys()
            for tok in a:
                assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def test_lone_prefills_of_a_hybrid_replay_padded_graphs(hybrid, monkeypatch):
    eager_llm = _llm(hybrid, "torch")
    bs = eager_llm.llm_engine.core.runner.block_size
    assert bs == 64  # (the smallest hybrid block: the sizes below count on it)
    prompts = _prompts(bs)
    want = _generate(eager_llm, prompts)
    eager_llm.shutdown()

    llm = _llm(hybrid)
    runner = llm.llm_engine.core.runner
    assert runner.forwarder.save_states  # prefix caching: block ends are saved
    graphs = ModelGraphs(runner.model, runner.backend, SHAPES, 320 // bs, runner.device,
                         block_size=bs, table_type=EagerGraphTable,
                         windows=runner.forwarder.windows,
                         group_backends=runner.graph_group_backends())
    graphs.capture()
    runner.graphs = runner.forwarder.graphs = graphs
    runs, eager = [], []
    real_run, real_eager = graphs.run, runner.forwarder._eager

    def run(shape, inp, fill, **kw):
        runs.append((shape.q, inp.num_tokens, inp.items[0].context_len))
        return real_run(shape, inp, fill, **kw)

    def eager_step(inp):
        eager.append((inp.num_tokens, inp.items[0].context_len))
        return real_eager(inp)

    graphs.run, runner.forwarder._eager = run, eager_step
    guarded = []
    forward = LinearAttention.forward

    def checked(self, hidden, md):
        chunks = (md.of(self.kv_group) if isinstance(md, GroupedMetadata) else md).chunks
        if not any(ch.count is not None for ch in chunks):
            return forward(self, hidden, md)
        guarded.append(len(chunks[0].saves))
        with NoHostReads():
            return forward(self, hidden, md)

    monkeypatch.setattr(LinearAttention, "forward", checked)
    got = _generate(llm, prompts)
    _same(got, want)
    prefills = [r for r in runs if r[0] > 1]
    assert prefills == [
        (128, bs + 20, 0),  # crosses the block end at bs: one save, fixed by q = 128
        (32, 20, bs),  # the prefix hit's tail, from the saved state
        (16, 11, 0),  # the first block of prompt 0 is cached, not its 11 tokens' state
    ]
    assert guarded and 1 in guarded and 0 in guarded
    # the 110-token prompt: its first chunk samples nothing, its second starts inside a block
    assert (100, 0) in eager and (10, 100) in eager
    assert sum(q == 1 for q, *_ in runs) >= 4 * 3  # decodes after each prompt

    # prompt logprobs: eagerly, the same as without graphs
    eager.clear()
    lp = _generate(llm, [prompts[2][:5]], prompt_logprobs=1)
    assert eager and eager[0] == (5, 0)
    assert lp[0].token_ids == _generate(llm, [prompts[2][:5]])[0].token_ids
    # padding never wrote the null block (reads of a fresh sequence's state)
    layer = next(a for a in runner.model.attention_layers() if isinstance(a, LinearAttention))
    conv, state = layer.pages.read(torch.tensor([runner.null_block]))
    assert not state.any() and not conv.any()


def test_a_prefill_graphs_state_ids_and_fallbacks():
    """[count, read, saves..., write]: the saves past the real tokens go to the trash block;
    a chunk starting inside a block fits only without prefix caching."""
    saving = StateGraphBuffers(0, 1, 64, save_block_ends=True)
    buf = saving.alloc_graph_buffers(1, 256, 8, torch.device("cpu"))
    table = [10, 11, 12, 13, 14]
    saving.fill_graph_buffers(buf, 1, 256, [64], [table], [5] * 70 + [-1] * 186,
                              lone_chunk=True)
    md = saving.graph_metadata(buf, 1, 256, lone_chunk=True)
    (ch,) = md.chunks
    assert ch.count.tolist() == [70] and len(ch.saves) == 3
    assert ch.blocks.tolist() == [10, 11, 1, 1, 12]  # read, save at 128, trash x2, write
    assert saving.chunk_fits(128) and not saving.chunk_fits(100)
    with pytest.raises(ValueError, match="block start"):
        saving.fill_graph_buffers(buf, 1, 256, [100], [table], [5] * 20, lone_chunk=True)
    plain = StateGraphBuffers(0, 1, 64)
    assert plain.chunk_fits(100) and plain.chunk_saves(256) == 0


def test_prefill_chunks_that_cannot_be_captured_run_eagerly(hybrid, monkeypatch):
    """If capturing a lone chunk's graph raises (the chunked rule's kernels doing what a
    capture refuses), the runner captures the decodes and verifies alone and the chunks run
    eagerly, as before hybrids had prefill graphs."""
    import shoal.worker.graph_capture as graph_capture

    llm = _llm(hybrid)
    runner = llm.llm_engine.core.runner
    built = []

    class Refusing(ModelGraphs):
        def __init__(self, *args, **kw):
            super().__init__(*args, table_type=EagerGraphTable, **kw)
            built.append(self)

        def capture(self) -> float:
            if any(q > 1 for q in self.prefill_sizes):
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture()

    monkeypatch.setattr(graph_capture, "ModelGraphs", Refusing)
    runner._capture_graphs()
    assert len(built) == 2 and runner.graphs is built[1]
    assert max(built[0].prefill_sizes) > 1 and max(built[1].prefill_sizes) == 1
    assert built[1].decode_sizes
    llm.shutdown()
