"""The GPU decode path on the CPU: the Triton backend under TRITON_INTERPRET=1 and the decode
CUDA-graph bookkeeping (padded batches, persistent buffers) with replay emulated eagerly."""

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

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from shoal.worker.prefill_graphs import PrefillGraphs  # noqa: E402
from shoal.worker.staged_tokens import StagedTokens  # noqa: E402
from shoal.worker.verify_graphs import VerifyGraphLadder, VerifyGraphs, draft_ladder  # noqa: E402


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay runs the captured call eagerly."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for dst, src in zip(self.out, self.fn()):  # (logits, hidden states)
            dst.copy_(src)


class EagerDecodeGraphs(DecodeGraphs):
    def capture(self) -> float:
        for size in self.sizes:
            md = self.backend.graph_metadata(self.buffers, size)
            ids, pos = self.tokens.view(size)

            def fn(ids=ids, pos=pos, md=md):
                return self._forward(ids, pos, md)

            self.backend.fill_graph_buffers(self.buffers, size, [], [], [])
            out = fn()
            self.graphs[size] = _EagerGraph(fn, out)
            self.outputs[size], self.hidden[size] = out
        return 0.0


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


def test_triton_backend_and_padded_decode_graphs_match_torch(tiny_llama_dir):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]}
               for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids
           for o in _llm(tiny_llama_dir, "torch").generate(prompts, params, use_tqdm=False)]

    llm = _llm(tiny_llama_dir, "triton")
    runner = llm.llm_engine.core.runner
    graphs = EagerDecodeGraphs(runner.model, runner.backend, 6, 96 // 4, runner.device,
                               block_size=4, sliding_window=None)
    graphs.capture()
    runner.graphs = graphs
    replays = []
    real_run = graphs.run

    def counting_run(*args, **kwargs):
        replays.append(len(args[0]))
        return real_run(*args, **kwargs)

    graphs.run = counting_run
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    # Decode-only steps went through the padded graph path, with batches of 3 and 5 padded.
    assert replays and any(n not in graphs.sizes for n in replays)


class EagerPrefillGraphs(PrefillGraphs):
    def capture(self, pool=None) -> float:
        for size in self.sizes:
            def fn(size=size):
                return self._forward(size)

            self.backend.fill_prefill_graph_buffers(self.buffers, size, 0, [], [])
            out = fn()
            self.graphs[size] = _EagerGraph(fn, out)
            self.outputs[size], self.hidden[size] = out
        return 0.0


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
    graphs = EagerPrefillGraphs(runner.model, runner.backend, 32, 96 // 4, runner.device,
                                block_size=4, sliding_window=None)
    assert graphs.sizes == [16, 32]
    graphs.capture()
    runner.prefill_graphs = graphs
    chunks = []
    real_run = graphs.run

    def counting_run(input_ids, positions, context_len, *a, **kw):
        chunks.append((len(input_ids), context_len))
        return real_run(input_ids, positions, context_len, *a, **kw)

    graphs.run = counting_run
    got = [llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for g, r in zip(got, ref):
        for a, b in zip(g.logprobs, r.logprobs):
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    # The first prompt ran whole; the later ones only past the 12 cached tokens (3 blocks).
    assert chunks == [(14, 0), (6, 12), (12, 12)]


class EagerVerifyGraphs(VerifyGraphs):
    def capture(self, pool=None) -> float:
        for size in self.sizes:
            def fn(size=size):
                return self._forward(size)

            self.backend.fill_verify_graph_buffers(self.buffers, size, [], [], [])
            out = fn()
            self.graphs[size] = _EagerGraph(fn, out)
            self.outputs[size], self.hidden[size] = out
        return 0.0


def test_verify_graphs_match_eager_verify_steps(tiny_llama_dir):
    """Speculative decoding's verify steps (every request k + 1 tokens) through the padded
    verify graphs give the tokens of the same steps run eagerly; batches of 3 pad to 4.
    Forced acceptance proposes k drafts every step (a lossless proposer on a random model
    rarely has k); each step's bonus token still comes from the verify forward's logits."""
    spec = {"method": "test_forced_acceptance", "num_speculative_tokens": 2,
            "acceptance_rate": 0.5}
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for n in (5, 9, 14)]
    # Different lengths: a request near its end verifies fewer than k drafts beside others.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 10, 13)]
    ref = [o.outputs[0].token_ids for o in _llm(tiny_llama_dir, "triton",
                                                 speculative_config=spec).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    graphs = EagerVerifyGraphs(runner.model, runner.backend, 2, 8, 96 // 4, runner.device,
                               block_size=4, sliding_window=None)
    graphs.capture()
    runner.verify_graphs = graphs
    batches = []
    real_run = graphs.run

    padded_real = []  # real tokens of each replay of all three requests

    def counting_run(input_ids, positions, context_lens, block_tables, slots, *a, **kw):
        batches.append(len(context_lens))
        if len(context_lens) == 3:
            padded_real.append(sum(s >= 0 for s in slots))
        return real_run(input_ids, positions, context_lens, block_tables, slots, *a, **kw)

    graphs.run = counting_run
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert 3 in batches  # a verify step of all three requests replayed the graph of 4
    # Requests with fewer drafts than k (the adaptive budget's) or none were padded.
    assert any(n < 3 * 3 for n in padded_real)


def test_verify_graph_ladder_picks_the_fewest_tokens(tiny_llama_dir):
    """Verify graphs for 1, 2 and 4 drafts (k = 4): a step replays the smallest that holds
    its longest request; output is the eager steps'."""
    spec = {"method": "test_forced_acceptance", "num_speculative_tokens": 4,
            "acceptance_rate": 0.5}
    assert draft_ladder(4) == [1, 2, 4] and draft_ladder(3) == [1, 2, 3]
    assert draft_ladder(1) == [1]
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for n in (6, 11)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 16)]
    ref = [o.outputs[0].token_ids for o in _llm(tiny_llama_dir, "triton",
                                                 speculative_config=spec).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    rungs = [EagerVerifyGraphs(runner.model, runner.backend, d, 8, 96 // 4, runner.device,
                               block_size=4, sliding_window=None) for d in draft_ladder(4)]
    used = []
    for g in rungs:
        g.capture()
        real_run = g.run

        def run(*a, g=g, real_run=real_run, **kw):
            used.append(g.q)
            return real_run(*a, **kw)
        g.run = run
    runner.verify_graphs = VerifyGraphLadder(rungs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert 5 in used and len(set(used)) >= 2, used  # full verifies and shorter ones


@pytest.mark.parametrize("name,async_scheduling", [("bigram", False), ("random", True)])
def test_mtp_drafts_from_the_graphs_hidden_states(tmp_path, name, async_scheduling):
    """With decode, verify and prefill graphs, MTP reads the target's hidden states from the
    graphs' outputs: output as without speculation, every draft the MTP formula's. With async
    scheduling (random weights: drafts fail, the backoff pipelines steps) the next step's
    replay overwrites a graph's outputs before the step before is mirrored."""
    target, ref = build_checkpoints(tmp_path)[name]
    # Long enough for rejected drafts to back off (async: pipelined steps then).
    sp = SamplingParams(temperature=0, max_tokens=20 if async_scheduling else 8, ignore_eos=True)
    prompts = random_prompts(3, seed=8, lo=2, hi=14)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    llm = tiny_llm(target, attention_backend="triton", async_scheduling=async_scheduling,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    steps = StepLog(llm)
    runner = llm.llm_engine.core.runner
    blocks = 256 // 4
    kw = dict(block_size=4, sliding_window=None, keep_hidden=True)
    runner.graphs = EagerDecodeGraphs(runner.model, runner.backend, 4, blocks, runner.device,
                                      **kw)
    runner.prefill_graphs = EagerPrefillGraphs(runner.model, runner.backend, 16, blocks,
                                               runner.device, **kw)
    runner.verify_graphs = EagerVerifyGraphs(runner.model, runner.backend, 2, 4, blocks,
                                             runner.device, **kw)
    replays = []
    for g in (runner.graphs, runner.prefill_graphs, runner.verify_graphs):
        g.capture()
        kind = type(g).__name__
        for graph in g.graphs.values():
            real = graph.replay
            graph.replay = lambda real=real, kind=kind: (replays.append(kind), real())
    log = record_proposals(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    alone = llm.generate(prompts[2], sp, use_tqdm=False)[0]  # its prefill: a prefill graph
    assert alone.outputs[0].token_ids == want[2]
    assert {"EagerVerifyGraphs", "EagerPrefillGraphs", "EagerDecodeGraphs"} <= set(replays)
    assert len(log) > 5
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq
    assert (steps.pipelined > 0) == async_scheduling


def test_a_prompt_chunk_of_k_plus_1_tokens_keeps_a_step_off_the_verify_graph(tiny_llama_dir):
    """A new prompt's last chunk of k + 1 tokens, scheduled beside verifies, samples one row:
    the step runs eagerly (replaying the verify graph would misalign every row after it)."""
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

    want = run(_llm(tiny_llama_dir, "triton", speculative_config=spec))
    llm = _llm(tiny_llama_dir, "triton", speculative_config=spec)
    runner = llm.llm_engine.core.runner
    graphs = EagerVerifyGraphs(runner.model, runner.backend, 2, 8, 96 // 4, runner.device,
                               block_size=4, sliding_window=None)
    graphs.capture()
    runner.verify_graphs = graphs
    assert run(llm) == want
    assert llm.llm_engine.core.scheduler.num_failed_steps == 0
