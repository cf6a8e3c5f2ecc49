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

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from shoal.worker.prefill_graphs import PrefillGraphs  # noqa: E402
from shoal.worker.staged_tokens import StagedTokens  # noqa: E402


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
            ids, pos = self.tokens.view(size)

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
            self.outputs[size] = out
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
