"""The offline API, shaped like vLLM's `LLM`: generate and chat over a batch of prompts."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from shoal.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    check_beam_search,
    decoder,
    step_position,
)
from shoal.engine.engine_args import EngineArgs
from shoal.engine.generation_defaults import default_sampling_params
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.request_errors import first_request_error
from shoal.inputs import prompt_list
from shoal.llm_lifecycle import LifecycleMixin
from shoal.llm_pooling import PoolingMixin
from shoal.lora_request import LoRARequest
from shoal.metrics.reader import Metric, get_metrics_snapshot
from shoal.multimodal.chat_parts import flatten_messages
from shoal.outputs import RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM(PoolingMixin, LifecycleMixin):
    """`LLM(model=None)` runs the embedded SmolLM2-135M-Instruct; an encoder model (e.g.
    `LLM("all-MiniLM-L6-v2")`) runs as a pooling model: embed, classify, score.

    A request the engine fails raises once the whole batch has ended (see _raise_if_failed):
    ValueError for a bad request, TimeoutError (RequestTimeoutError) past request_timeout,
    RuntimeError (EngineRequestError) when the engine failed it."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        engine_args.setdefault("disable_log_stats", True)  # (vLLM's LLM default)
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = LLMEngine(self.engine_args)

    def shutdown(self) -> None:
        """Persists the CPU KV tier to the disk tier (when both are configured); also runs at
        interpreter exit."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's statistics under vLLM's names (Counter, Vector,
        Gauge and Histogram of shoal.metrics.reader). Needs LLM(..., disable_log_stats=False)."""
        registry = self.llm_engine.metrics_registry
        if registry is None:
            raise ValueError("get_metrics needs statistics: create the LLM with "
                             "disable_log_stats=False")
        return get_metrics_snapshot(registry)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling params generate and chat use when given none, from the
        model's generation_config.json (--generation-config; engine/generation_defaults.py),
        else SamplingParams()."""
        return default_sampling_params(self.llm_engine.inputs.limits.generation)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt
        (enable_lora). A flat list of token ids is one prompt (as vLLM parses it)."""
        prompts = prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority needs one value per prompt ({len(prompts)}), got {len(priority)}")
        eng = self.llm_engine
        prompts = _media_first(eng.inputs, prompts)
        # Validate every request before any of them runs.
        reqs = [eng.process_request(eng.next_request_id(), p, sp,
                                    priority=priority[i] if priority else 0,
                                    lora_request=loras[i])
                for i, (p, sp) in enumerate(zip(prompts, params))]
        for r in reqs:
            eng.submit(r)
        return self._run([r.request_id for r in reqs], use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation or a list of them. continue_final_message:
        the prompt ends inside the last (assistant) message, which the model continues
        (add_generation_prompt=False). tools: function definitions the chat template
        renders (as chat_template_kwargs["tools"]). Content parts are flattened to text
        (and images), so chat_template_content_format takes "auto" or "string"."""
        if not messages:
            raise ValueError("messages must not be empty")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format must be 'auto' or 'string' "
                             f"(got {chat_template_content_format!r}): content parts are "
                             "given to the template as text")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: images are processed "
                             "with the model's defaults")
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
                raise ValueError("tools must be a list of tool definitions")
            kwargs.setdefault("tools", [dict(t) for t in tools])
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        params = self._params_list(sampling_params, len(conversations))
        eng = self.llm_engine
        mm = eng.inputs.mm
        prompts = []
        for c, sp in zip(conversations, params):  # image parts: placeholders, images beside
            flat, sources = flatten_messages(list(c), mm.image_placeholder if mm else None)
            p = eng.inputs.process_chat(flat, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        truncate=None if sources else sp.truncate_prompt_tokens,
                                        chat_template=chat_template,
                                        chat_template_kwargs=kwargs or None)
            if sources:
                p = eng.inputs.with_images(p, {"image": mm.load(sources)})
            prompts.append(p)
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the best `params.beam_width` beams of each prompt, best
        first; each step runs every live beam of every prompt as one batch of one-token
        requests."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams (got {type(params).__name__})")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        eng = self.llm_engine
        processed = [eng.inputs.process(p) for p in prompts]
        for p in processed:
            check_beam_search(params, len(p.prompt_token_ids), eng.inputs.max_model_len,
                              self.engine_args.max_logprobs, eng.inputs.limits.request.max_n)
        eos = eng.inputs.limits.eos_token_ids
        searches = [BeamSearch(p.prompt_token_ids, params, eos) for p in processed]
        step_params = params.step_params()
        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True) \
            if use_tqdm else None
        try:
            while any(not s.done for s in searches):
                reqs = [[eng.inputs.process_request(eng.next_request_id(),
                                                    {"prompt_token_ids": seq}, step_params)
                         for seq in s.pending()] for s in searches]
                for r in (r for rs in reqs for r in rs):
                    eng.submit(r)
                outs = iter(self._run([r.request_id for rs in reqs for r in rs], False))
                for s, rs in zip(searches, reqs):
                    if rs:
                        s.advance([step_position(next(outs)) for _ in rs])
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        decode = decoder(eng.tokenizer)
        return [BeamSearchOutput(sequences=s.best(decode)) for s in searches]

    def _params_list(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int
                     ) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"sampling_params needs one entry per prompt ({n}), got {len(sp)}")
        return sp

    @staticmethod
    def _lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
                   ) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        if isinstance(lora, (str, bytes)) or not isinstance(lora, Sequence):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them (got "
                             f"{type(lora).__name__})")
        loras = list(lora)
        if len(loras) != n:
            raise ValueError(f"lora_request needs one entry per prompt ({n}), got {len(loras)}")
        return loras

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        eng = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        in_toks = out_toks = 0
        start = time.perf_counter()
        try:
            # Until the engine is idle, not just until these requests are done: with async
            # scheduling a step whose tokens are dropped may still be in flight. DP+EP: until
            # every replica is idle (each steps with the others, see engine/dp_lockstep.py).
            eng.join_replicas()
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            in_toks += len(out.prompt_token_ids)
                            if isinstance(out, RequestOutput):
                                out_toks += sum(len(o.token_ids) for o in out.outputs)
                            dt = time.perf_counter() - start
                            bar.set_postfix_str(f"est. speed input: {in_toks / dt:.2f} toks/s, "
                                                f"output: {out_toks / dt:.2f} toks/s")
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        outs = [done[r] for r in ids]
        _raise_if_failed(outs)
        return outs


def _raise_if_failed(outs: list[Any]) -> None:
    """A batch in which the engine failed a request raises that request's error (the first
    in order; every other request has ended, and all the outputs are on the exception's
    `outputs`): a ValueError for a bad request, a TimeoutError past request_timeout, a
    RuntimeError for an engine failure (shoal/engine/request_errors.py)."""
    exc = first_request_error(outs)
    if exc is None:
        return
    exc.outputs = outs
    raise exc


def _media_first(inputs: Any, prompts: list[Any]) -> list[Any]:
    """The prompts carrying images or videos processed on the media threads, several at once
    (their text tokenized here first, one at a time); the others as they are."""
    mm_at = [i for i, p in enumerate(prompts)
             if isinstance(p, Mapping) and p.get("multi_modal_data") is not None]
    if inputs.mm is None or len(mm_at) < 2:
        return prompts
    texts = [(inputs.process({k: v for k, v in prompts[i].items() if k != "multi_modal_data"}),
              prompts[i]["multi_modal_data"]) for i in mm_at]
    done = inputs.mm.map(lambda pair: inputs.with_images(*pair), texts)
    out = list(prompts)
    for i, p in zip(mm_at, done):
        out[i] = p
    return out
