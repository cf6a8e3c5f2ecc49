"""A step's tokens for one request: which the runner produced (one sampled token, or a verified
run of accepted drafts and one more), which of them the request keeps (up to the first that
ends it: a stop token, its length limit, the end of its grammar), and the output that reports
them. Plain functions over the request: the scheduler applies them."""

from __future__ import annotations

from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.core.types import EngineCoreOutput, Logprobs


def produced_tokens(serial: int, result: ModelRunnerOutput
                    ) -> tuple[list[int], list[Logprobs] | None]:
    """The request's tokens this step and their logprobs (None: not asked for)."""
    tokens = result.verified_token_ids.get(serial)
    if tokens is not None:
        return tokens, result.verified_logprobs.get(serial)
    lp = result.logprobs.get(serial)
    return [result.sampled_token_ids[serial]], [lp] if lp is not None else None


def keep_tokens(req: Request, tokens: list[int], max_model_len: int
                ) -> tuple[list[int], RequestStatus | None]:
    """Appends the tokens to the request up to the first that ends it; returns those kept and
    how the request ends (None: it goes on)."""
    if len(tokens) == 1:  # the usual step: no draft was verified
        req.append_output_token(tokens[0])
        return tokens, check_grammar(req, tokens[0]) or check_stop(req, tokens[0],
                                                                    max_model_len)
    for n, token in enumerate(tokens, 1):
        req.append_output_token(token)
        status = check_grammar(req, token) or check_stop(req, token, max_model_len)
        if status is not None:
            return tokens[:n], status
    return tokens, None


def check_grammar(req: Request, token: int) -> RequestStatus | None:
    """Advances a structured request's grammar: it stops once the grammar is complete (its
    stop token accepted, which ignore_eos cannot skip)."""
    if req.structured is None:
        return None
    return _advance_grammar(req, token)


def _advance_grammar(req: Request, token: int) -> RequestStatus | None:
    if not req.structured.accept(token):
        # The bitmask only allows what the grammar accepts; a token outside it means the
        # row had nothing allowed (e.g. min_tokens banned the only stop token).
        return RequestStatus.FINISHED_ERROR
    if req.structured.ended:  # accept() asked the matcher once
        # xgrammar completes on EOS; guidance may complete on an ordinary token, whose
        # text stays
        req.stopped_on_token = token in req.eos_token_ids
        return RequestStatus.FINISHED_STOPPED
    return None


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    sp = req.sampling_params
    n_out = req.num_output_tokens
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and token in req.eos_token_ids:
            req.stopped_on_token = True
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            req.stop_reason, req.stopped_on_token = token, True
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def token_output(req: Request, tokens: list[int], lps: list[Logprobs] | None,
                 prompt_lp: list | None, status: RequestStatus | None) -> EngineCoreOutput:
    """The output of a step's kept tokens (status: how the request ended, if it did)."""
    out = EngineCoreOutput(
        request_id=req.request_id,
        new_token_ids=tokens,
        new_logprobs=lps[:len(tokens)] if lps else None,
        prompt_logprobs=prompt_lp,
        num_cached_tokens=req.num_cached_tokens,
    )
    if req.num_output_tokens == 1 and req.first_scheduled_time is not None:
        out.queue_time = max(0.0, req.first_scheduled_time - req.arrival_time)
    if status == RequestStatus.FINISHED_ERROR:
        out.finish_reason = "error"
        out.error = "the sampled token does not fit the request's grammar"
        out.error_code = ErrorCode.OUTSIDE_GRAMMAR
    elif status is not None:
        out.finish_reason = "stop" if status == RequestStatus.FINISHED_STOPPED else "length"
        out.stop_reason = req.stop_reason
        out.stop_token = req.stopped_on_token
    return out
