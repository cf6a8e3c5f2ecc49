"""The scheduler's side of a step's results (a base of Scheduler: it reads the scheduler's
request table, KV manager, drafts budget and failed-block books): the sampled tokens kept up
to a stop, the accepted drafts settled, finished requests ended."""

from __future__ import annotations

from typing import Any

from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from shoal.core.types import EngineCoreOutput
from shoal.engine.request_table import engine_failed_message, error_output
from shoal.engine.token_results import keep_tokens, produced_tokens, token_output


class StepResults:
    # what Scheduler provides (declared for readers and type checkers)
    config: Any
    table: Any
    kv: Any
    drafts: Any
    failed_blocks: Any
    suspects: Any
    offload: Any
    connector: Any
    _states: bool
    _step_generation_tokens: int

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Applies a step's results. With async scheduling the next step may already be
        scheduled: a request may meanwhile have been preempted (its token still counts) or
        have ended (its results are dropped). Results are matched on serials, so a request
        that took the id of one that ended meanwhile gets nothing of it. KV copies the runner
        reports done release their CPU slots, whatever became of the requests they were
        for."""
        if self.offload is not None and result.kv_transfers_done:
            self.offload.transfers_done(result.kv_transfers_done)
        if result.kv_saved:  # a producer's prompts, kept for the engines that fetch them
            self.connector.saved(result.kv_saved)
        outputs = self.table.take_pending_outputs()
        for item in sched.scheduled:
            error = result.failed_errors.get(item.serial)
            failed = error is not None or item.serial in result.failed_serials
            if item.sample and self.failed_blocks.pending:
                self.failed_blocks.settle(item.serial, failed)
            req = self.table.by_serial.get(item.serial)
            if req is None:
                continue  # ended while the step ran
            if item.sample:
                req.num_pending_tokens -= 1
            if failed:
                # error: under DP+EP, an adapter the step could not have (lora/
                # shared_expert_slots.py). ENGINE_FAILED, as on one rank, where that failed
                # load raises and fail_steps ends the request
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(
                    error_output(req, "the model produced non-finite logits",
                                 ErrorCode.NON_FINITE) if error is None else
                    error_output(req, engine_failed_message(error), ErrorCode.ENGINE_FAILED))
                continue
            prompt_lp = result.prompt_logprobs.get(req.serial)
            if item.sample:
                outputs.append(self._apply_tokens(req, item, result, prompt_lp))
            elif prompt_lp:
                outputs.append(EngineCoreOutput(req.request_id, [], prompt_logprobs=prompt_lp,
                                                num_cached_tokens=req.num_cached_tokens))
        return outputs

    def _apply_tokens(self, req: Request, item: ScheduledRequest, result: ModelRunnerOutput,
                      prompt_lp: list | None) -> EngineCoreOutput:
        """The step's token for the request, or with speculative decoding its accepted
        drafts and one more, up to the first that ends it."""
        tokens, lps = produced_tokens(req.serial, result)
        if item.num_draft_tokens:
            self._settle_verified(req, item.num_draft_tokens, len(tokens) - 1)
        tokens, status = keep_tokens(req, tokens, self.config.max_model_len)
        self._step_generation_tokens += len(tokens)
        if req.suspect:  # (a call per request and step is a cost at batch 256)
            self.suspects.sampled_fine(req)
        drafts = result.draft_token_ids.get(req.serial)
        # A constrained request's drafts are checked by its grammar at verify time (each
        # position masked as if the drafts before it were accepted).
        if drafts and status is None and req.status == RequestStatus.RUNNING:
            req.spec_token_ids = drafts
            req.spec_probs = result.draft_probs.get(req.serial, [])
        out = token_output(req, tokens, lps, prompt_lp, status)
        if status is not None and self.connector is not None:
            out.kv_transfer_params = self.connector.transfer_params(req)
        if status is not None:
            self._end(req, status)
        return out

    def _settle_verified(self, req: Request, num_drafts: int, accepted: int) -> None:
        """A verified step: counted, and the KV slots of rejected drafts of a request still
        running rolled back (blocks past its accepted tokens return to the pool)."""
        self.drafts.settle(req, num_drafts, accepted)
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= num_drafts - accepted
            self.kv.trim(req)
            if self._states:  # linear-attention layers fold the accepted run in next step
                req.state_replay = accepted + 1

