"""The scheduler's side of speculative decoding (a mixin of Scheduler).

A decoding request with drafts is scheduled for 1 + k tokens: its last known token and the
k drafts, which the runner verifies in the same forward pass. Their KV slots count as
computed while the step runs; once its results are in, the slots of rejected drafts are
rolled back (num_computed_tokens goes back and whole blocks past the accepted tokens return
to the pool). Prefix-cache hashes are made from `all_token_ids`, which only ever holds
accepted tokens, so no draft reaches the cache.

A request whose drafts keep failing stops paying for them: after MISSES_BEFORE_BACKOFF verify
steps in a row with nothing accepted, it decodes without drafts for a while (4 steps, doubling
with each further miss, at most 64), then tries again; one accepted draft resets it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    from shoal.config import SchedulerConfig
    from shoal.kv_cache.manager import KVCacheManager


MISSES_BEFORE_BACKOFF = 2
MAX_BACKOFF_STEPS = 64


class SpecDecodeScheduling:
    config: SchedulerConfig
    kv: KVCacheManager

    def _init_spec(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_per_pos = [0] * num_speculative_tokens

    def _num_drafts(self, req: Request, room: int) -> int:
        """How many of the request's drafts to verify this step: none unless it decodes with
        nothing in flight, and never past its max_tokens or max_model_len (a verified step
        yields up to k+1 tokens), nor past the step's budget left after its own token."""
        if not req.spec_token_ids or req.num_pending_tokens:
            return 0
        if req.spec_skip > 0:  # backing off after drafts that kept failing
            req.spec_skip -= 1
            return 0
        return max(0, min(len(req.spec_token_ids), room,
                          req.max_tokens - req.num_output_tokens - 1,
                          self.config.max_model_len - req.num_tokens - 1))

    def _settle_verified(self, req: Request, item: ScheduledRequest, tokens: list[int]) -> None:
        """Counts a verified step (tokens: the accepted drafts then one more) and rolls back
        the KV slots of the rejected drafts of a request still running."""
        k = item.num_draft_tokens
        accepted = len(tokens) - 1
        self._spec_drafts += 1
        self._spec_draft_tokens += k
        self._spec_accepted += accepted
        for pos in range(accepted):
            self._spec_per_pos[pos] += 1
        req.spec_misses = 0 if accepted else req.spec_misses + 1
        if req.spec_misses >= MISSES_BEFORE_BACKOFF:
            req.spec_skip = min(4 << (req.spec_misses - MISSES_BEFORE_BACKOFF),
                                MAX_BACKOFF_STEPS)
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= k - accepted
            self.kv.trim(req)

    def _take_spec_stats(self) -> dict:
        if not self._spec_drafts:
            return {}
        stats = dict(spec_num_drafts=self._spec_drafts,
                     spec_num_draft_tokens=self._spec_draft_tokens,
                     spec_num_accepted_tokens=self._spec_accepted,
                     spec_num_accepted_tokens_per_pos=self._spec_per_pos)
        self._init_spec(self.num_speculative_tokens)
        return stats
