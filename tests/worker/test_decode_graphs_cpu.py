"""The GPU decode path on the CPU: the Triton backend under TRITON_INTERPRET=1 and the decode
CUDA-graph bookkeeping (padded batches, persistent buffers) with replay emulated eagerly."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from shoal.worker.prefill_graphs import PrefillGraphs  # noqa: E402


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay runs the captured call eagerly."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class EagerDecodeGraphs(DecodeGraphs):
    def capture(self) -> float:
        for size in self.sizes:
            md = self.backend.graph_metadata(self.buffers, size)
            ids, pos = self.input_ids[:size], self.positions[:size]

            def fn(ids=ids, pos=pos, md=md):
                return self._forward(ids, pos, md)

            self.backend.fill_graph_buffers(self.buffers, size, [], [], [])
            out = fn()
            self.graphs[size] = _EagerGraph(fn, out)
            self.outputs[size] = out
        return 0.0


def test_capture_sizes_follow_vllm():
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


def _llm(path, backend: str, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("SHOAL_ATTENTION_BACKEND", backend)
    return LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
               num_gpu_blocks_override=128, max_model_len=96, max_num_seqs=6, **kw)


def test_triton_backend_and_padded_decode_graphs_match_torch(tiny_llama_dir, monkeypatch):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]}
               for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids
           for o in _llm(tiny_llama_dir, "torch", monkeypatch).generate(prompts, params, use_tqdm=False)]

    llm = _llm(tiny_llama_dir, "triton", monkeypatch)
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
            self.outputs[size] = out
        return 0.0


def test_single_prefill_graphs_match_torch_with_cached_prefixes(tiny_llama_dir, monkeypatch):
    """Lone prefill chunks (fresh prompts, and tails after a prefix-cache hit) run through the
    padded prefill graphs, async scheduling on, and give the torch backend's tokens."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(13)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(n)]}
               for n in (1, 5, 11)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    ref_llm = _llm(tiny_llama_dir, "torch", monkeypatch)
    ref = [ref_llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in prompts]

    llm = _llm(tiny_llama_dir, "triton", monkeypatch, async_scheduling=True)
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
