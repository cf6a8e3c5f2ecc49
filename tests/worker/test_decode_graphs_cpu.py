"""The GPU step path on the CPU: the Triton backend under TRITON_INTERPRET=1 and the CUDA-graph
table's bookkeeping (padded shapes of decode, verify and prefill steps, persistent buffers)
with replay emulated eagerly (worker/eager_graphs.py)."""

from __future__ import annotations

import os

import torch

# triton.jit reads TRITON_INTERPRET when a kernel is defined: set it before the engine
# imports the kernel modules (it does so lazily, when the Triton backend is chosen).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from spec_decode.proposal_log import StepLog, record_proposals  # noqa: E402
from spec_decode.test_mtp import build_checkpoints  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.worker.graph_table import StepShape  # noqa: E402
from shoal.worker.model_graphs import (  # noqa: E402
    ModelGraphs,
    capture_sizes,
    draft_ladder,
    step_shapes,
)
from shoal.worker.staged_tokens import StagedTokens  # noqa: E402


def test_capture_sizes_follow_vllm():
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


def _llm(path, backend: str, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
               num_gpu_blocks_override=128, max_model_len=96, max_num_seqs=6,
               attention_backend=backend, **kw)


def test_staged_tokens_land_in_contiguous_rows_from_alternating_host_buffers():
    staged = StagedTokens(3, 8, torch.device("cpu"))
    first = staged.stage(4, ([5, 6, 7], [0, 1, 2], [2]))
    assert first.is_contiguous() and first.data_ptr() == staged.buffer.data_ptr()
    assert first.tolist() == [[5, 6, 7, 0], [0, 1, 2, 0], [2, 0, 0, 0]]
    # A smaller size reads its own contiguous prefix of the buffer, padding zeroed.
    assert staged.stage(2, ([9], [3], [0])).tolist() == [[9, 0], [3, 0], [0, 0]]
    assert staged.buffer[:6].tolist() == [9, 0, 3, 0, 0, 0]
    # The two host buffers alternate: the third stage reuses the first one's memory.
    hosts = [h.ctypes.data for h in staged._host]
    assert hosts[0] != hosts[1] and staged._turn == 0
    staged.stage(4, ([1], [1], [1]))
    assert staged._turn == 1 and staged._host[0][:3].tolist() == [1, 0, 0]
    with pytest.raises(ValueError):
        staged.stage(2, ([1, 2, 3], [], []))


def _graphs(runner, shapes, max_blocks: int, **kw) -> ModelGraphs:
    """A captured table of `shapes` on the runner (replays emulated eagerly), each run logged
    in .runs as (shape, real requests)."""
    graphs = ModelGraphs(runner.model, runner.backend, shapes, max_blocks, runner.device,
                         block_size=4, table_type=EagerGraphTable, **kw)
    graphs.capture()
    graphs.runs = []
    real_run = graphs.run

    def run(shape, inp, fill):
        graphs.runs.append((shape, len(inp.items)))
        return real_run(shape, inp, fill)
    graphs.run = run
    runner.graphs = graphs
    return graphs


def test_triton_backend_and_padded_decode_graphs_match_torch(tiny_llama_dir):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]}
               for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids
           for o in _llm(tiny_llama_dir, "torch").generate(prompts, params, use_tqdm=False)]

    llm = _llm(tiny_llama_dir, "triton")
    runner = llm.llm_engine.core.runner
    graphs = _graphs(runner, [StepShape(b, 1) for b in capture_sizes(6)], 96 // 4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    # Decode-only steps went through the padded graph path, with batches of 3 and 5 padded.
    assert graphs.runs and any(shape.rows != n for shape, n in graphs.runs)


def test_single_prefill_graphs_match_torch_with_cached_prefixes(tiny_llama_dir):
    """Lone prefill chunks (fresh prompts, and tails after a prefix-cache hit) run through the
    padded prefill graphs, async scheduling on, and give the torch backend's tokens."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(13)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(n)]}
               for n in (1, 5, 11)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    ref_llm = _llm(tiny_llama_dir, "torch")
    ref = [ref_llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in prompts]

    llm = _llm(tiny_llama_dir, "triton", async_scheduling=True)
    runner = llm.llm_engine.core.runner
    shapes = [s for s in step_shapes(6, 32) if s.rows == 1 and s.q > 1]
    assert [s.q for s in shapes] == [16, 32]
    graphs = _graphs(runner, shapes, 96 // 4)
    chunks = []
    real_run = graphs.run

    def counting_run(shape, inp, fill):
        chunks.append((inp.num_tokens, inp.items[0].context_len))
        return real_run(shape, inp, fill)

    graphs.run = counting_run
    got = [llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for g, r in zip(got, ref):
        for a, b in zip(g.logprobs, r.logprobs):
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    # The first prompt ran whole; the later ones only past the 12 cached tokens (3 blocks).
    assert chunks == [(14, 0), (6, 12), (12, 12)]


def test_verify_graphs_match_eager_verify_steps(tiny_llama_dir):
    """Speculative decoding's verify steps (every request k + 1 tokens) through the padded
    verify graphs give the tokens of the same steps run eagerly (by the torch backend: the
    interpreted Triton kernels would double the test's time, and the graphs' tokens must be
    its tokens all the same); batches of 3 pad to 4.
    Forced acceptance proposes k drafts every step (a lossless proposer on a random model
    rarely has k); each step's bonus token still comes from the verify forward's logits."""
    spec = {"method": "test_forced_acceptance", "num_speculative_tokens": 2,
            "acceptance_rate": 0.5}
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for n in (5, 9, 14)]
    # Different lengths: a request near its end verifies fewer than k drafts beside others.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 10, 13)]
    ref = [o.outputs[0].token_ids for o in _llm(tiny_llama_dir, "torch",
                                                 speculative_config=spec).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    # k = 2: the full verify only; up to 4 rows (three requests: 8 would never replay, and
    # each captured shape is an interpreted forward)
    shapes = [StepShape(b, 3, 3) for b in (1, 2, 4)]
    graphs = _graphs(runner, shapes, 96 // 4)
    padded_real = []  # real tokens of each replay of all three requests
    real_run = graphs.run

    def counting_run(shape, inp, fill):
        if len(inp.items) == 3:
            padded_real.append(inp.num_tokens)
        return real_run(shape, inp, fill)

    graphs.run = counting_run
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    # A verify step of all three requests replayed the graph of 4.
    assert (StepShape(4, 3, 3), 3) in graphs.runs
    # Requests with fewer drafts than k (the adaptive budget's) or none were padded.
    assert any(n < 3 * 3 for n in padded_real)


def test_verify_graph_ladder_picks_the_fewest_tokens(tiny_llama_dir):
    """Verify graphs for 1, 2 and 4 drafts (k = 4): a step replays the smallest that holds
    its longest request; output is the eager steps' (torch backend: see above)."""
    spec = {"method": "test_forced_acceptance", "num_speculative_tokens": 4,
            "acceptance_rate": 0.5}
    assert draft_ladder(4) == [1, 2, 4] and draft_ladder(3) == [1, 2, 3]
    assert draft_ladder(1) == [1]
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for n in (6, 11)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 16)]
    ref = [o.outputs[0].token_ids for o in _llm(tiny_llama_dir, "torch",
                                                 speculative_config=spec).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    shapes = [s for s in step_shapes(8, 32, prefill=False, num_speculative_tokens=4)
              if s.q > 1 and s.rows <= 2]  # two requests: larger batches never replay
    assert sorted({s.q for s in shapes}) == [2, 3, 5]
    graphs = _graphs(runner, shapes, 96 // 4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    used = [shape.q for shape, _ in graphs.runs]
    assert 5 in used and len(set(used)) >= 2, used  # full verifies and shorter ones


@pytest.fixture(scope="module")
def mtp_ckpts(tmp_path_factory):
    """Both MTP checkpoints, built once for the two cases below."""
    return build_checkpoints(tmp_path_factory.mktemp("mtp"))


@pytest.mark.parametrize("name,async_scheduling", [("bigram", False), ("random", True)])
def test_mtp_drafts_from_the_graphs_hidden_states(mtp_ckpts, name, async_scheduling):
    """With decode, verify and prefill graphs, MTP reads the target's hidden states from the
    graphs' outputs: output as without speculation, every draft the MTP formula's. With async
    scheduling (random weights: drafts fail, the backoff pipelines steps) the next step's
    replay overwrites a graph's outputs before the step before is mirrored."""
    target, ref = mtp_ckpts[name]
    # Long enough for rejected drafts to back off (async: pipelined steps then; 6 of them at
    # 14 tokens).
    sp = SamplingParams(temperature=0, max_tokens=14 if async_scheduling else 8, ignore_eos=True)
    prompts = random_prompts(3, seed=8, lo=2, hi=14)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    # Up to 96 tokens (requests reach 35): the graphs' latent decode then runs in one split
    # (tiny_llm's 256 took two and a reduce, 40% of the interpreted time; the split kernels
    # have their own tests).
    llm = tiny_llm(target, attention_backend="triton", async_scheduling=async_scheduling,
                   max_model_len=96,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    steps = StepLog(llm)
    runner = llm.llm_engine.core.runner
    shapes = step_shapes(4, 16, num_speculative_tokens=2)
    graphs = _graphs(runner, shapes, 96 // 4, keep_hidden=True)
    log = record_proposals(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    alone = llm.generate(prompts[2], sp, use_tqdm=False)[0]  # its prefill: a prefill graph
    assert alone.outputs[0].token_ids == want[2]
    kinds = {"verify" if s.logits_per_row > 1 else "prefill" if s.q > 1 else "decode"
             for s, _ in graphs.runs}
    assert kinds == {"verify", "prefill", "decode"}
    assert len(log) > 5
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert (steps.pipelined > 0) == async_scheduling


def test_a_prompt_chunk_beside_verifies_samples_its_last_row_only(tiny_llama_dir):
    """A new prompt's last chunk of k + 1 tokens, scheduled beside verifies, samples one row:
    through the verify graph, whose logits are every position's, only that row is taken
    (taking all of them would misalign every row after it)."""
    spec = {"method": "test_forced_acceptance", "num_speculative_tokens": 2,
            "acceptance_rate": 0.5}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = {"prompt_token_ids": [5, 9, 44, 71, 3, 8]}
    b = {"prompt_token_ids": [17, 29, 61]}  # k + 1 tokens

    def run(llm) -> list[list[int]]:
        engine = llm.llm_engine
        engine.add_request("a", a, params)
        for _ in range(3):
            engine.step()
        engine.add_request("b", b, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done["a"], done["b"]]

    want = run(_llm(tiny_llama_dir, "torch", speculative_config=spec))  # eager (see above)
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    # two requests: larger batches would never replay (each is an interpreted capture)
    graphs = _graphs(runner, [StepShape(b, 3, 3) for b in (1, 2)], 96 // 4)
    assert run(llm) == want
    assert graphs.runs
    assert llm.llm_engine.core.scheduler.suspects.num_failed_steps == 0


@pytest.mark.parametrize("stale_before_window", [False, True])
def test_a_hybrid_sliding_model_through_the_graphs_matches_torch(tmp_path, monkeypatch,
                                                                 stale_before_window):
    """Qwen2 with a sliding layer beside a full one (two KV cache groups, each its own graph
    buffers: block tables and slots) through decode and prefill graphs, contexts well past
    the window: the torch backend's tokens. stale_before_window: a fill writes a window
    group's last entries only (no tile margin here) over host staging filled with another
    real block's id, so an entry before the window that a kernel read would show."""
    from oracle import write_tiny_checkpoint

    from shoal.attention import triton_backend

    tails = []  # fills that skipped a window group's entries before the window
    if stale_before_window:
        monkeypatch.setattr(triton_backend, "WINDOW_TILE_TOKENS", 0)
        fill = triton_backend.TritonAttentionBackend._fill_tables

        def poisoned(buf, turn, tables, last=None):
            if last is not None:
                tails.append(last < max(len(t) for t in tables))
                buf.host_tables[turn].fill(3)
            fill(buf, turn, tables, last)
        monkeypatch.setattr(triton_backend.TritonAttentionBackend, "_fill_tables",
                            staticmethod(poisoned))

    path = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2", seed=6, use_sliding_window=True,
                                 sliding_window=8, max_window_layers=1)
    rng = random.Random(9)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (9, 20)]
    # contexts of 19 and 30 tokens: well past the window of 8
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [o.outputs[0].token_ids
           for o in _llm(path, "torch").generate(prompts, params, use_tqdm=False)]
    llm = _llm(path, "triton")
    runner = llm.llm_engine.core.runner
    assert [g.sliding_window for g in runner.kv_groups] == [None, 8]
    graphs = _graphs(runner, step_shapes(6, 32), 96 // 4, windows=(None, 8))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]  # a lone prefill chunk
    assert alone.outputs[0].token_ids == ref[1]
    assert {s.q > 1 for s, _ in graphs.runs} == {True, False}  # prefill and decode graphs
    assert any(tails) == stale_before_window


def test_hybrid_decode_graphs_match_eager(tmp_path):
    """Gated DeltaNet beside attention: decode steps replay through the graph table with the
    linear-state groups' read/write buffers (padding rows write the trash block), and give
    the eager steps' tokens."""
    from models.test_qwen3_next import KINDS
    from oracle import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "hybrid", "qwen3_next", seed=1,
                                 **KINDS["qwen3_next"])
    rng = random.Random(2)
    # One prompt decodes past its first block of 64 (a table of two blocks in the graph); the
    # rest stay short: each prompt token is an interpreted prefill, which this test is not about.
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for n in (8, 60, 3, 21, 14)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", max_num_batched_tokens=64, num_gpu_blocks_override=64,
              max_model_len=256, max_num_seqs=6)
    ref = [o.outputs[0].token_ids for o in LLM(model=str(path), attention_backend="torch", **kw)
           .generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(path), attention_backend="triton", **kw)
    runner = llm.llm_engine.core.runner
    graphs = ModelGraphs(runner.model, runner.backend, [StepShape(b, 1) for b in capture_sizes(6)],
                         256 // 64, runner.device, block_size=64, table_type=EagerGraphTable,
                         windows=runner.forwarder.windows,
                         group_backends=runner.graph_group_backends())
    graphs.capture()
    runner.graphs = graphs
    replays = []
    real_run = graphs.run

    def run(shape, inp, fill):
        replays.append((shape.rows, len(inp.items)))
        return real_run(shape, inp, fill)
    graphs.run = run
    trash = runner.null_block + 1
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert any(rows > n for rows, n in replays)  # padded decode batches replayed
    # padding rows wrote their states into the trash block, never the null block
    layer = runner.model.attention_layers()[0]
    conv, state = layer.pages.read(torch.tensor([runner.null_block, trash]))
    assert not state[0].any() and not conv[0].any()
