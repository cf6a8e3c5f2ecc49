"""W6's llama.cpp worker: the same requests on the same GGUF file through llama-cpp-python.

Run by benchmarks/w6_cpu_throughput.py (`--engines shoal,vllm,llamacpp`) in a virtualenv
with `llama-cpp-python==0.3.36` (built for this CPU), never imported by shoal. It imports only
the standard library, numpy and llama_cpp, and writes the same result keys as the other
workers, so the parent puts the three engines side by side.

llama.cpp's Python API generates one sequence per call, so batch 1 is plain `Llama.generate`.
Its batched figure comes from llama.cpp's own multi-sequence decoding through the low-level
API (what llama.cpp's `batched` example does): every request is a sequence of one context,
prompts are fed in chunks of up to n_batch tokens, then each step decodes one token of every
running sequence in a single `llama_decode`; greedy, ignore_eos. It runs with n_seq_max =
`--parallel` sequences at a time (64: W6's batch), so the output tok/s is llama.cpp's best
batched throughput on these requests, not a loop of batch-1 calls."""

from __future__ import annotations

import ctypes
from typing import Any


def load(gguf: str, n_ctx: int, threads: int) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_ubatch=512,
                 n_threads=threads, n_threads_batch=threads, verbose=False)


def batched_context(llm: Any, n_ctx: int, n_seq: int, threads: int) -> Any:
    """A second context on the loaded model that holds `n_seq` sequences (the high-level
    Llama makes single-sequence contexts)."""
    import llama_cpp as lc

    p = lc.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 2048, 512, n_seq
    p.n_threads = p.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, p)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens "
                           f"for {n_seq} sequences")
    return ctx


def generate_one(llm: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy batch-1 generation, ignoring EOS."""
    llm.reset()
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if len(out) >= max_tokens:
            break
    return out


def generate_batched(ctx: Any, n_vocab: int, reqs: list[tuple[list[int], int]],
                     parallel: int, n_batch: int = 2048) -> list[list[int]]:
    """Greedy generation of every request, `parallel` sequences at a time, each decode step
    one llama_decode over one token of every running sequence."""
    import llama_cpp as lc
    import numpy as np

    outs: list[list[int]] = [[] for _ in reqs]
    pending = list(range(len(reqs)))
    batch = lc.llama_batch_init(max(n_batch, parallel), 0, 1)
    mem = lc.llama_get_memory(ctx)
    try:
        while pending:
            group, pending = pending[:parallel], pending[parallel:]
            lc.llama_memory_clear(mem, True)
            last_row: dict[int, int] = {}  # request -> its row of logits in the last decode
            pos = {r: 0 for r in group}
            # Prefill: prompts in chunks of up to n_batch tokens, logits only at each end.
            feed = [(r, i, t) for r in group for i, t in enumerate(reqs[r][0])]
            for start in range(0, len(feed), n_batch):
                chunk = feed[start:start + n_batch]
                batch.n_tokens = len(chunk)
                for j, (r, i, t) in enumerate(chunk):
                    slot = group.index(r)
                    batch.token[j], batch.pos[j] = t, i
                    batch.n_seq_id[j], batch.seq_id[j][0] = 1, slot
                    end = i == len(reqs[r][0]) - 1
                    batch.logits[j] = end
                    if end:
                        last_row[r] = j
                    pos[r] = i + 1
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed during prefill")
                _take(ctx, n_vocab, outs, last_row, np)
                last_row = {}
            running = [r for r in group if len(outs[r]) < reqs[r][1]]
            while running:
                batch.n_tokens = len(running)
                for j, r in enumerate(running):
                    batch.token[j], batch.pos[j] = outs[r][-1], pos[r]
                    batch.n_seq_id[j], batch.seq_id[j][0] = 1, group.index(r)
                    batch.logits[j] = True
                    pos[r] += 1
                    last_row[r] = j
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed during decode")
                _take(ctx, n_vocab, outs, last_row, np)
                last_row = {}
                running = [r for r in running if len(outs[r]) < reqs[r][1]]
    finally:
        lc.llama_batch_free(batch)
    return outs


def _take(ctx: Any, n_vocab: int, outs: list[list[int]], rows: dict[int, int], np: Any) -> None:
    """Appends the argmax token of each request's logits row of the last decode."""
    import llama_cpp as lc

    for r, j in rows.items():
        ptr = lc.llama_get_logits_ith(ctx, j)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_vocab,))
        outs[r].append(int(logits.argmax()))


# KV cells per sequence of the batched context: W6 needs at most 512 + 256.
SEQ_CTX = 1024


class LlamaCppRunner:
    """The W6 worker's Runner interface: generate(list of (prompt ids, max_tokens)); batches
    run `parallel` sequences at a time (set it before each batch)."""

    def __init__(self, gguf: str, threads: int, max_model_len: int) -> None:
        self.threads = threads
        self.llm = load(gguf, n_ctx=max_model_len, threads=threads)
        self.n_vocab = self.llm.n_vocab()
        self.parallel = 64
        self._contexts: dict[int, Any] = {}

    def generate(self, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
        if len(reqs) == 1:
            return [generate_one(self.llm, *reqs[0])]
        if self.parallel not in self._contexts:
            self._contexts[self.parallel] = batched_context(
                self.llm, SEQ_CTX * self.parallel, self.parallel, self.threads)
        return generate_batched(self._contexts[self.parallel], self.n_vocab, reqs,
                                self.parallel)

