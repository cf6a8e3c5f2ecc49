"""Grammars for the engine core: compiled off the step loop, one matcher per request.

Compilations run in a small thread pool and are cached by (kind, spec), so a schema that
many requests share compiles once. A request waits in the scheduler until its own grammar is
ready (`StructuredRequest.is_ready`); the others go on. Each step the core asks for the
bitmask of the structured rows it samples; the scheduler advances a request's matcher on each
token it accepts."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from shoal.structured_output.backend import GrammarBackend, GrammarMatcher
from shoal.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 1024  # compiled grammars kept (most recently used)


def grammar_vocab_size(tokenizer: Any, model_vocab_size: int,
                       eos_token_ids: list[int] | None = None) -> int:
    """The ids a grammar decides about: the tokenizer's, at most the model's. Logits padded
    past the tokenizer (Qwen3: 151,936 against 151,669 ids) are banned without asking the
    grammar engine, which would treat each padding id as a special token on every fill and
    accept: a Qwen3-shaped model with SmolLM2's 49,152-id tokenizer filled 110-125 us a row
    instead of 3-4 on the H200 host. The model's end-of-sequence ids are always inside: a
    finished grammar allows only them."""
    try:
        size = len(tokenizer)
    except TypeError:  # no tokenizer, or one that does not say its size
        return model_vocab_size
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if added:  # added ids may sit past len() when the vocabulary has gaps
        size = max(size, max(added) + 1)
    if eos_token_ids:
        size = max(size, max(eos_token_ids) + 1)
    return min(size, model_vocab_size)


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
                 ) -> GrammarBackend:
    """name: xgrammar, guidance, auto (xgrammar) or none (neither installed). Imports the
    library here: it loads torch, which only the engine core may."""
    if tokenizer is None:
        raise ValueError("structured outputs need a tokenizer in the engine (the model has none)")
    if name in ("auto", "xgrammar"):
        from shoal.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "guidance":
        from shoal.structured_output.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "none":  # "auto" found neither library at start-up
        raise ValueError("structured outputs need the xgrammar or llguidance package, and "
                         "neither is installed where the engine runs")
    raise ValueError(f"unknown structured outputs backend {name!r} (supported: auto, xgrammar, "
                     "guidance)")


class StructuredRequest:
    """One request's grammar: a compilation in flight, then a matcher of its own."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future):
        self.params = params
        self._compiled = compiled
        self._matcher: GrammarMatcher | None = None
        self._usable = False  # compiled without error, as the engine has seen (settle)

    def is_ready(self) -> bool:
        """The scheduler may run the request: its grammar compiled and the engine core saw
        that it did (a compilation finishing between the core's check and the schedule must
        not let a failed grammar run)."""
        return self._usable

    def is_compiled(self) -> bool:
        return self._compiled.done()

    def settle(self) -> str | None:
        """Once compiled: makes the request schedulable, or returns why the grammar failed."""
        if not self._compiled.done():
            return None
        exc = self._compiled.exception()
        if exc is not None:
            return str(exc)
        self._usable = True
        return None

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            backend, compiled = self._compiled.result()
            self._matcher = backend.matcher(compiled)
        return self._matcher

    # The grammar refused a token or is complete: the request ends. A step scheduled behind
    # it (async scheduling) still has its row, whose token is dropped: nothing to fill.
    ended = False

    def accept(self, token_id: int) -> bool:
        """Advances the grammar on the request's next token; False if it does not fit. Once a
        row a step: is_terminated() is asked only after a token that may complete the
        grammar (GrammarMatcher.stop_token_ids)."""
        m = self._matcher if self._matcher is not None else self.matcher
        ok = m.accept(token_id)
        if not ok:
            self.ended = True
        elif (m.stop_token_ids is None or token_id in m.stop_token_ids) and m.is_terminated():
            self.ended = True
        return ok

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 max_workers: int = 2, pin_memory: bool = False):
        self.backend_name = backend
        # the bitmask's width
        self.vocab_size = grammar_vocab_size(tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="shoal-grammar")
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pin = pin_memory
        self._buffer: torch.Tensor | None = None

    # ---- compilation ------------------------------------------------------------------------
    def _get_backend(self) -> GrammarBackend:
        # Built on the first compilation (importing the library and reading the vocabulary
        # takes a second or two): in the pool, never in the step loop.
        with self._backend_lock:
            if self._backend is None:
                self._backend = make_backend(self.backend_name, self._tokenizer,
                                             self.vocab_size, self._eos)
            return self._backend

    def _compile(self, params: StructuredOutputsParams) -> tuple[GrammarBackend, Any]:
        backend = self._get_backend()
        return backend, backend.compile(params)

    def _future(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        fut = self._cache.get(key)
        if fut is None:
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return fut

    def request(self, params: StructuredOutputsParams) -> StructuredRequest:
        """Starts (or finds) the request's compilation; returns at once."""
        return StructuredRequest(params, self._future(params))

    def validate(self, params: StructuredOutputsParams) -> None:
        """Waits for the compilation (offline, where a bad constraint must be a ValueError
        before the request is queued); the grammar stays cached for the request."""
        self._future(params).result()

    @staticmethod
    def wait_any(pending: list[StructuredRequest], timeout: float) -> None:
        """Blocks until one of the compilations finishes (an engine with nothing else to do)."""
        futures = [r._compiled for r in pending if not r.is_compiled()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- bitmasks ---------------------------------------------------------------------------
    def _rows(self, n: int) -> torch.Tensor:
        words = -(-self.vocab_size // 32)
        buf = self._buffer
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 16), words, dtype=torch.int32,
                              pin_memory=self._pin)
            self._buffer = buf
        return buf[:n]

    def fill_bitmask(self, requests: list[StructuredRequest],
                     drafts: list[list[int]] | None = None) -> torch.Tensor:
        """[len(requests), ceil(grammar vocab / 32)] int32 on the host: row i allows the
        tokens requests[i]'s grammar accepts next (ids past the grammar's vocabulary are
        banned by apply_token_bitmask). With drafts (speculative decoding), see
        _fill_with_drafts."""
        if drafts is not None and any(drafts):
            return self._fill_with_drafts(requests, drafts)
        n = len(requests)
        bitmask = self._rows(n)
        backend = self._backend if self._backend is not None else self._get_backend()
        matchers = [r.matcher for r in requests if not r.ended]
        if len(matchers) == n:
            if not backend.fills_whole_rows:
                bitmask.fill_(-1)
            backend.fill_bitmasks(matchers, bitmask)
        else:
            # A grammar that ended in the step before (async scheduling) has no next token;
            # its row's token is dropped: allow everything there.
            bitmask.fill_(-1)
            if matchers:
                backend.fill_bitmasks(matchers, bitmask,
                                      [i for i, r in enumerate(requests) if not r.ended])
        return bitmask

    def _fill_with_drafts(self, requests: list[StructuredRequest],
                          drafts: list[list[int]]) -> torch.Tensor:
        """A verify step: len(drafts[i]) + 1 rows per request, in order, row j allowing what
        the grammar accepts after the request's first j drafts. The matcher walks the drafts
        and is rolled back, so only the tokens the scheduler keeps advance it. Rows past a
        draft the grammar refuses (it is rejected there: its masked probability is 0) or
        past the grammar's end (the request stops there) allow everything, as do a
        request's rows once its grammar has ended."""
        bitmask = self._rows(sum(len(d) + 1 for d in drafts))
        bitmask.fill_(-1)
        row = 0
        for r, d in zip(requests, drafts):
            start, row = row, row + len(d) + 1
            if r.ended:
                continue
            m = r.matcher
            m.fill_bitmask(bitmask, start)
            walked = 0
            for j, token in enumerate(d):
                # Asked of the row just filled, not of the matcher: a refused token may leave
                # a matcher in an error state that rollback does not clear (llguidance).
                if token >= self.vocab_size or not (int(bitmask[start + j, token >> 5])
                                                    >> (token & 31)) & 1:
                    break
                if not m.accept(token):
                    break
                walked += 1
                if m.is_terminated():
                    break
                m.fill_bitmask(bitmask, start + j + 1)
            if walked:
                m.rollback(walked)
        return bitmask
