"""Beam search over an engine that samples one token per request (vLLM's frontend design).

Each step runs every live beam as a one-token request asking for the top 2 * beam_width
logprobs; every (beam, candidate token) pair scores the beam's cumulative logprob plus the
candidate's; a candidate that is EOS ends its beam (kept aside as completed, unless
ignore_eos), and the best beam_width of the rest live on. At the end the completed and live
beams are ranked by cumulative logprob / length ** length_penalty and the best beam_width are
returned. Both drivers (offline `LLM.beam_search`, the server's `use_beam_search`) share this
state machine and differ only in how they run a step's requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from shoal.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from shoal.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), the logprobs of each generated position."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: Collection[int],
               length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, the EOS not counted in the length (as
    transformers and vLLM rank finished hypotheses)."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """The state of one prompt's search; `pending()` says what the next step must run."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: Collection[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.live = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        """The token sequences (prompt + beam) whose next-token logprobs the step needs."""
        return [] if self.done else [b.tokens for b in self.live]

    def advance(self, positions: Sequence[PositionLogprobs | None]) -> None:
        """Takes one step's logprobs, one position per `pending()` sequence, in order."""
        if len(positions) != len(self.live):
            raise ValueError(f"need one logprobs position per live beam ({len(self.live)}), "
                             f"got {len(positions)}")
        width, ignore_eos = self.params.beam_width, self.params.ignore_eos
        candidates: list[tuple[float, int, BeamSearchSequence, PositionLogprobs]] = []
        for beam, pos in zip(self.live, positions):
            for token, lp in (pos or {}).items():
                score = beam.cum_logprob + lp.logprob
                if token in self.eos and not ignore_eos:
                    kept = beam.tokens + [token] if self.params.include_stop_str_in_output \
                        else beam.tokens
                    self.completed.append(BeamSearchSequence(
                        tokens=kept, logprobs=beam.logprobs + [pos], cum_logprob=score,
                        finish_reason="stop", stop_reason=token))
                else:
                    candidates.append((score, token, beam, pos))
        # Stable on ties: the earlier beam and its earlier (higher-ranked) candidate win.
        candidates.sort(key=lambda c: -c[0])
        self.live = [BeamSearchSequence(tokens=beam.tokens + [token],
                                        logprobs=beam.logprobs + [pos], cum_logprob=score)
                     for score, token, beam, pos in candidates[:width]]
        self.steps += 1

    def best(self, decode: Callable[[list[int], bool], str] | None) -> list[BeamSearchSequence]:
        """The best beam_width beams, best first, with their generated text."""
        pool = self.completed + self.live
        pool.sort(key=lambda b: beam_score(b.tokens, b.cum_logprob, self.eos,
                                           self.params.length_penalty), reverse=True)
        best = pool[: self.params.beam_width]
        for b in best:
            if b.finish_reason is None:
                b.finish_reason = "length"
            generated = b.tokens[self.prompt_len:]
            if generated and generated[-1] in self.eos and not self.params.ignore_eos:
                generated = generated[:-1]  # the EOS is not part of the text
            b.text = decode(generated, self.params.skip_special_tokens) if decode else ""
        return best

    def request_output(self, request_id: str, prompt: str | None,
                       decode: Callable[[list[int], bool], str] | None) -> RequestOutput:
        """The result shaped like a sampled request's: one completion per beam, best first."""
        best = self.best(decode)
        outputs = [CompletionOutput(index=i, text=b.text or "",
                                    token_ids=b.tokens[self.prompt_len:],
                                    cumulative_logprob=b.cum_logprob, logprobs=b.logprobs,
                                    finish_reason=b.finish_reason, stop_reason=b.stop_reason)
                   for i, b in enumerate(best)]
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=None, outputs=outputs, finished=True)


def check_beam_search(params: BeamSearchParams, prompt_len: int, max_model_len: int,
                      max_logprobs: int, max_width: int, width_field: str = "beam_width"
                      ) -> None:
    """What the engine would refuse about the step requests, named as the caller knows it;
    the width is also held to the engine's max_n (each step runs that many requests)."""
    if params.beam_width > max_width:
        raise ValueError(f"{width_field} must be <= {max_width} (the engine's max_n) for beam "
                         f"search (got {params.beam_width})")
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise ValueError(f"{width_field} must be <= {max_logprobs // 2}: beam search asks for "
                         f"the top 2 * {width_field} logprobs per step, and the server's "
                         f"--max-logprobs is {max_logprobs}")
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens is too large: this model's maximum context length is "
                         f"{max_model_len} tokens, but {prompt_len + params.max_tokens} were "
                         f"requested ({prompt_len} in the prompt, {params.max_tokens} in the "
                         "completion)")


def step_position(out: RequestOutput) -> PositionLogprobs:
    """The logprobs of a finished one-token step request; raises if it did not run."""
    c = out.outputs[0] if out.outputs else None
    if c is None or c.finish_reason in ("abort", "error") or not c.logprobs:
        reason = c.finish_reason if c is not None else "no output"
        raise RuntimeError(f"a beam search step ended without logprobs ({reason})")
    return c.logprobs[0]


def decoder(tokenizer) -> Callable[[list[int], bool], str] | None:
    """(token ids, skip special tokens) -> text, or None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
