"""Runs beam search (shoal/beam_search.py) on the server's engine: each step submits every
live beam of every prompt as a one-token request, waits for all of them, and advances the
searches; a step that fails aborts the rest of its requests and ends the search."""

from __future__ import annotations

import asyncio
import contextlib

from shoal.beam_search import BeamSearch, decoder, step_position
from shoal.engine.async_llm import AsyncLLM, RequestStream
from shoal.engine.input_processor import ProcessedPrompt
from shoal.lora_request import LoRARequest
from shoal.outputs import RequestOutput
from shoal.sampling_params import BeamSearchParams


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise RuntimeError(f"beam search step {stream.request_id} ended without an output")
    return last


class BeamSearchRunner:
    def __init__(self, engine: AsyncLLM, request_id: str, params: BeamSearchParams, *,
                 priority: int = 0, cache_salt: str | None = None,
                 lora_request: LoRARequest | None = None):
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request

    async def run(self, prompts: list[ProcessedPrompt]) -> list[RequestOutput]:
        """One finished RequestOutput per prompt: its best beams as completions, best first."""
        searches = [BeamSearch(p.prompt_token_ids, self.params, self.engine.limits.eos_token_ids)
                    for p in prompts]
        step_params = self.params.step_params()
        step = 0
        while any(not s.done for s in searches):
            counts: list[int] = []
            streams: list[RequestStream] = []
            try:
                for si, s in enumerate(searches):
                    pending = s.pending()
                    for b, seq in enumerate(pending):
                        streams.append(self.engine.add_request(
                            f"{self.request_id}-{si}-{step}-{b}", {"prompt_token_ids": seq},
                            step_params, priority=self.priority, cache_salt=self.cache_salt,
                            lora_request=self.lora_request))
                    counts.append(len(pending))
                results = iter(await asyncio.gather(*(_last(st) for st in streams)))
            finally:
                for st in streams:
                    with contextlib.suppress(Exception):
                        st.abort()
            for s, count in zip(searches, counts):
                if count:
                    s.advance([step_position(next(results)) for _ in range(count)])
            step += 1
        decode = decoder(self.engine.tokenizer)
        return [s.request_output(f"{self.request_id}-{i}", p.prompt, decode)
                for i, (s, p) in enumerate(zip(searches, prompts))]
