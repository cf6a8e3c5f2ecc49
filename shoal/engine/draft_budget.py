"""The scheduler's side of speculative decoding: how many drafts each request verifies.

A decoding request with drafts is scheduled for 1 + k tokens: its last known token and the
k drafts, which the runner verifies in the same forward pass. Their KV slots count as
computed while the step runs; once its results are in, the slots of rejected drafts are
rolled back (num_computed_tokens goes back and whole blocks past the accepted tokens return
to the pool). Prefix-cache hashes are made from `all_token_ids`, which only ever holds
accepted tokens, so no draft reaches the cache.

A request whose drafts keep failing stops paying for them: after MISSES_BEFORE_BACKOFF verify
steps in a row with nothing accepted, while its acceptance estimate is below BACKOFF_BELOW, or
after MISSES_ALWAYS_BACKOFF whatever the estimate (MISSES_BEFORE_FIRST_HIT while none of its
drafts was ever accepted), it decodes without drafts for a while (4 decode steps, doubling
with each further miss, at most MAX_BACKOFF_STEPS), then tries again; one accepted draft
resets it. Confidence-scheduled verification (below) counts a step whose drafts it
skipped for low confidence as such a miss, so a drafter that is never sure stops drafting
for a while too (its proposals cost a drafting pass and the step's pipelining).
With async scheduling the engine asks `wants_drafts` before each step: while no request would
verify drafts next, steps are pipelined (see engine/core.py). The scheduler rolls back the KV
slots of rejected drafts (settle() says how many were accepted).

Adaptive budget (on unless speculative_config says adaptive_budget=false): each request keeps
an estimate p of the chance that its next draft is accepted once the drafts before it were,
from counts of accepted drafts and of first rejections. Every decode step decays them so the
estimate follows recent text; a step that verifies none of its drafts (backing off,
pipelined, or skipped by the rules here) moves them as far toward the prior instead, so a
new request, and one not verified for a while, is at p = 0.8 (age_counts). Decaying toward 0
there, as before issue 38, let the estimate of an unverified request drift to 0.5, under the
worth threshold above ~37 requests: it seldom verified again, whatever its drafts were worth.
The j-th draft is verified while p**j, the chance it is reached and accepted, is at least
the step's worth threshold, which rises with the batch: at a few requests a decode reads
every weight for one token and verifying a few more costs little, so a draft right one time
in ten pays; beyond, a verified draft adds about a token to the step and a decoded token is
worth 1/running of it, so above 32 requests the threshold is running / (running +
WORTH_HALF_BATCH), up to MAX_WORTH: towards a compute-bound device only drafts that are
almost sure are worth it. (Its linear ramp to 0.9 at 64 had been out of the estimate's reach
there: nothing verified at 64, whatever the acceptance, while the drafter still ran.)
Simulated with H100 W9 step times (benchmarks/draft_budget_sim.py, 256 tokens in lockstep):
48 requests at a = 0.8 take 134 steps, 1.42x plain (before: 255, 0.86x); 64 at a = 0.8 and
1.0: 1.25x and 2.5x (0.83x); 32 with confidence, a = 0.8: 1.18x (0.97x). a = 0 costs at most
0.1% more (at 48 and 64, 12-17% less: failing drafts are verified and back off, where they
were skipped and drafted on; with a free drafter, as W9's forced method, 1% more there); a =
0.5 with confidence at 32, 1.8% more. With disable_by_batch_size (vLLM's key) no request
drafts while that many or more are running.

Confidence-scheduled verification (speculative_config confidence_threshold c; None, the
default, turns it off): drafters that know how sure they are (mtp, eagle: the softmax of the
head's logits at each greedy draft) send each draft's probability p_i with it; of the drafts
the rules above allow, a request verifies the longest prefix j with
    a * p_1 * ... * p_j >= confidence_threshold(c, running) = c * min(1, running / 32)
where a is its acceptance estimate (1 when adaptive_budget is off), at least 0 drafts (0: a
plain decode step). The threshold rises with the batch (monotone, reaching c at
CONFIDENCE_FULL_BATCH requests) for the reason the worth threshold does. Drafts without
probabilities (ngram, draft_model) count as sure (1.0). The stats count, by draft position,
the drafts that reached a decode step (proposed), those verified and those accepted.

Draft limits (issue 38): a drafter drafted k tokens at every step's finish, wherever the
budget then verified fewer or none (W9 at forced acceptance 0, batch 32 on the H100: a
mirror pass at 80 steps of 256 and a k-deep draft chain at 25, for 13 verify steps). With
the adaptive budget each scheduled decode step carries, per outcome of its own verification
(drafts accepted), the drafts its next step can verify at most (draft_limits: the budget on
the counts as settle() and the next step's aging will leave them, at this step's batch
size); the drafter, which knows the outcome when it drafts, drafts no deeper, and keeps the
rows of a request whose limit is 0 for later as a paused one's (no mirror, no drafts). A
step whose every outcome gives 0 is paused at launch (drafts_paused), and wants_drafts skips
it. A limit is an upper bound: confidence, room and max_tokens only lower the next count,
and a batch that shrinks meanwhile lowers the worth threshold (a request then verifies at
most what was drafted)."""

from __future__ import annotations

from shoal.core.request import Request

MISSES_BEFORE_BACKOFF = 2
# ...and only while the acceptance estimate is this low: a request whose single draft is right
# half the time misses twice in a row every fourth step, and backing off then (the backoff
# doubles with each miss) left it almost no drafts (W9 batch 32, a = 0.5: 253 steps for 256
# tokens, 0.80x plain on the H200).
BACKOFF_BELOW = 0.3
# At larger batches the adaptive budget stops verifying a failing request's drafts before its
# estimate falls below BACKOFF_BELOW, and the decay lifts the estimate back over the worth
# threshold every ~6 steps: a verify step each time, never a longer pause (W9 batch 32, a = 0:
# 34 verify steps of 256, 67 not pipelined; 0.946x plain on the H100; with this rule 13 and
# 25). Drafts right half the time miss eight in a row once in 256 runs: in 32 requests in
# lockstep at a = 0.5, 2% more steps in a simulation (6 misses: 5%; every step there verifies
# for some request, so a request's backoff saves no verify step).
MISSES_ALWAYS_BACKOFF = 8
# A request none of whose drafts was ever accepted has an estimate that is still mostly the
# prior (0.8): it fell below BACKOFF_BELOW only after 6 misses in a row, 6 of W9's 13 verify
# steps at a = 0, batch 1 (each one not pipelined, a draft chain and a mirror for EAGLE-3).
# Drafts right half the time miss their first three one time in eight: a 4-step pause.
MISSES_BEFORE_FIRST_HIT = 3
MAX_BACKOFF_STEPS = 64
# Adaptive budget: the worth threshold is MIN_WORTH up to DRAFT_COST_FREE_BATCH running
# requests, then rises linearly (towards MAX_WORTH at DRAFT_COST_FULL_BATCH)...
MIN_WORTH, MAX_WORTH = 0.1, 0.9
DRAFT_COST_FREE_BATCH, DRAFT_COST_FULL_BATCH = 8, 64
# ...up to 32 running requests; above, running / (running + WORTH_HALF_BATCH), capped at
# MAX_WORTH (reached at 360). A draft pays when p**j >= s * running / t(running), a step
# costing t = c + s * tokens: a curve of that form, with c / s for this constant (H100, 8B:
# 6.05 ms + 0.021 ms a token, c / s = 283); 40 keeps the ramp's margin (drafting, verify
# steps not pipelined) and meets it at 32, so up to there nothing changed.
WORTH_HALF_BATCH = 40
ACCEPT_DECAY = 0.8  # per decode step, on the acceptance counts (see age_counts)
PRIOR_HITS, PRIOR_FAILS = 3.0, 0.0  # a new request starts at p = 0.8: it gets its k drafts
CONFIDENCE_FULL_BATCH = 32  # the confidence threshold reaches its setting at this batch


def draft_limits(hits: float, fails: float, misses: int, num_drafts: int, k: int,
                 threshold: float, ever_accepted: bool = True) -> tuple[int, ...]:
    """Per outcome of a decode step verifying num_drafts drafts (index a: a of them
    accepted; one entry for a step verifying none), the drafts its next step verifies at
    most: adaptive_num_drafts on the counts (hits, fails: as num_drafts() left them for this
    step) after settle() adds the outcome and the next step ages them; 0 for a full miss
    that backs the request off (ever_accepted: as backs_off_after)."""
    out = []
    for a in range(num_drafts + 1):
        h, f = hits + a, fails + (a < num_drafts)
        if num_drafts and not a and backs_off_after(misses + 1, h, f, ever_accepted):
            out.append(0)
        else:
            out.append(adaptive_num_drafts(h * ACCEPT_DECAY, f * ACCEPT_DECAY, k, threshold))
    return tuple(out)


def confidence_threshold(threshold: float, running: int) -> float:
    """The least a * p_1 * ... * p_j for which a j-th draft is verified, with `running`
    requests: the setting scaled by min(1, running / CONFIDENCE_FULL_BATCH)."""
    return threshold * min(1.0, running / CONFIDENCE_FULL_BATCH)


def confident_num_drafts(probs: list[float], k: int, estimate: float, threshold: float) -> int:
    """Drafts worth verifying by confidence: the largest j <= k with
    estimate * prod(probs[:j]) >= threshold (a draft past the known probabilities: 1.0)."""
    j, reach = 0, estimate
    while j < k:
        reach *= probs[j] if j < len(probs) else 1.0
        if reach < threshold:
            break
        j += 1
    return j


def worth_threshold(running: int) -> float:
    """The least p**j for which verifying a j-th draft pays, with `running` requests: the
    ramp from MIN_WORTH at DRAFT_COST_FREE_BATCH (towards MAX_WORTH at DRAFT_COST_FULL_BATCH)
    up to where it meets running / (running + WORTH_HALF_BATCH), at 32, then that curve up
    to MAX_WORTH (at 360)."""
    span = DRAFT_COST_FULL_BATCH - DRAFT_COST_FREE_BATCH
    x = min(max(running - DRAFT_COST_FREE_BATCH, 0) / span, 1.0)
    ramp = MIN_WORTH + x * (MAX_WORTH - MIN_WORTH)
    return min(ramp, max(MIN_WORTH, running / (running + WORTH_HALF_BATCH)))


def age_counts(hits: float, fails: float, verified: bool) -> tuple[float, float]:
    """The acceptance counts one decode step later: decayed by ACCEPT_DECAY, and in a step
    that verifies none of the request's drafts (settle() adds nothing) moved that share of
    the way to the prior instead, so without evidence the estimate returns to 0.8."""
    if verified:
        return hits * ACCEPT_DECAY, fails * ACCEPT_DECAY
    return (PRIOR_HITS + (hits - PRIOR_HITS) * ACCEPT_DECAY,
            PRIOR_FAILS + (fails - PRIOR_FAILS) * ACCEPT_DECAY)


def backs_off_after(misses: int, hits: float, fails: float, ever_accepted: bool = True
                    ) -> bool:
    """Whether `misses` misses in a row, with these acceptance counts, back a request off
    (ever_accepted: whether any draft of the request was accepted)."""
    always = MISSES_ALWAYS_BACKOFF if ever_accepted else MISSES_BEFORE_FIRST_HIT
    return misses >= MISSES_BEFORE_BACKOFF and (
        misses >= always or acceptance_estimate(hits, fails) < BACKOFF_BELOW)


def backs_off_on_a_miss(req: Request) -> bool:
    """Whether DraftBudget.settle backs the request off if its verify step now accepts none of
    its drafts (its counts as settle() finds them: aged for the step by num_drafts). The
    scheduler marks such a step's drafts paused (drafts_paused, below)."""
    return backs_off_after(req.spec_misses + 1, req.spec_hits, req.spec_fails + 1,
                           req.spec_ever_accepted)


def drafts_paused(req: Request, num_drafts: int, pipelined: bool = True) -> bool:
    """ScheduledRequest.drafts_paused of a request scheduled with num_drafts drafts to verify
    (its backoff already counted down for this step): a hidden-state drafter keeps such a
    step's rows for later (spec_decode/mirror_backlog.py) rather than mirroring them and
    drafting from them at the step's finish, which the device waits for when nothing was
    launched behind the step (issue 38). Paused:
    - while the request still backs off after this step. With pipelined steps (async
      scheduling) the step whose next step is the last paused one is not: its finish
      usually runs beside that next step's forward pass, and there catches the kept rows up,
      so the finish that drafts for the following verify step (run alone) mirrors one row
      per request, not a backlog. Without pipelining that finish is the latest one, so it
      would only draft for a step that verifies nothing: it is paused too;
    - a verify step whose full miss would back the request off: a full miss leaves one row
      to mirror, which the drafter then keeps (no drafts nobody verifies); a step that accepts
      drafts leaves more rows and is mirrored and drafted from as ever;
    - a step whose every outcome leaves the next step no draft to verify (draft_limits)."""
    if req.spec_skip:
        return req.spec_skip > int(pipelined)
    if req.spec_draft_limits and not any(req.spec_draft_limits):
        return True  # no outcome of this step leaves its next step a draft to verify
    return num_drafts > 0 and backs_off_on_a_miss(req)


def acceptance_estimate(hits: float, fails: float) -> float:
    """p, the chance that a draft is accepted once the drafts before it were, from the
    decayed counts with one success and one failure added (Laplace)."""
    return (hits + 1.0) / (hits + fails + 2.0)


def adaptive_num_drafts(hits: float, fails: float, k: int, threshold: float) -> int:
    """Drafts worth verifying: the largest j <= k with p**j >= threshold."""
    p = acceptance_estimate(hits, fails)
    j, reach = 0, 1.0
    while j < k and reach * p >= threshold:
        reach *= p
        j += 1
    return j


class DraftBudget:
    def __init__(self, num_speculative_tokens: int, max_model_len: int, adaptive: bool = True,
                 disable_by_batch_size: int | None = None, confidence: float | None = None):
        """num_speculative_tokens: k, the drafts a request is proposed (0: no speculation);
        confidence: the confidence threshold's setting (None: off)."""
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.confidence = confidence
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * self.k
        self._proposed_pos = [0] * self.k
        self._verified_pos = [0] * self.k

    def num_drafts(self, req: Request, room: int, allowed: bool, running: int) -> int:
        """How many of the request's drafts to verify in this decode step: none unless drafts
        are allowed (no step in flight) and it decodes with nothing in flight, and never past
        its max_tokens or max_model_len (a verified step yields up to k+1 tokens), nor past
        the step's budget left after its own token. Every decode step counts down a backoff
        and ages the acceptance counts, with drafts or without (see age_counts)."""
        paused = req.spec_skip > 0  # backing off after drafts that kept failing
        # The decision is made on the counts decayed for this step, as a verified step leaves
        # them before settle() adds its outcome.
        hits, fails = req.spec_hits, req.spec_fails
        req.spec_hits, req.spec_fails = age_counts(hits, fails, verified=True)
        if paused:
            req.spec_skip -= 1
            n = 0
        else:
            n = self._verified_drafts(req, room, allowed, running)
        if not n:
            req.spec_hits, req.spec_fails = age_counts(hits, fails, verified=False)
        req.spec_draft_limits = self._limits(req, n, running)
        return n

    def _limits(self, req: Request, n: int, running: int) -> tuple[int, ...]:
        """Request.spec_draft_limits of a decode step verifying n drafts (see draft_limits):
        none while it backs off past this step (drafts_paused decides) or without the
        adaptive budget; all 0 while disable_by_batch_size holds."""
        if req.spec_skip or not self.adaptive:
            return ()
        cap = self.disable_by_batch_size
        if cap is not None and running >= cap:
            return (0,) * (n + 1)
        return draft_limits(req.spec_hits, req.spec_fails, req.spec_misses, n, self.k,
                            worth_threshold(running), req.spec_ever_accepted)

    def _verified_drafts(self, req: Request, room: int, allowed: bool, running: int) -> int:
        """num_drafts for a request not backing off, its counts aged for the step."""
        if not allowed or not req.spec_token_ids or req.num_pending_tokens:
            return 0
        for pos in range(min(len(req.spec_token_ids), self.k)):
            self._proposed_pos[pos] += 1
        worth = self._budget(req, len(req.spec_token_ids), running)
        k = self._confident(req, worth, running)
        if worth and not k:  # skipped for low confidence: a miss (see the module's doc)
            req.spec_misses += 1
            self._back_off(req)
        return max(0, min(k, room, req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _budget(self, req: Request, k: int, running: int) -> int:
        """Of k drafts, how many are worth verifying with `running` requests in the batch."""
        cap = self.disable_by_batch_size
        if cap is not None and running >= cap:
            return 0
        if self.adaptive:
            return adaptive_num_drafts(req.spec_hits, req.spec_fails, k, worth_threshold(running))
        return k

    def _confident(self, req: Request, k: int, running: int) -> int:
        """Of k drafts, those confidence-scheduled verification keeps (all when it is off)."""
        if self.confidence is None or k == 0:
            return k
        estimate = (acceptance_estimate(req.spec_hits, req.spec_fails) if self.adaptive
                    else 1.0)
        return confident_num_drafts(req.spec_probs, k, estimate,
                                    confidence_threshold(self.confidence, running))

    def wants_drafts(self, running: list[Request], proposals_known: bool) -> bool:
        """Whether the next step would verify drafts for some running request, were they
        proposed from the step in flight: the engine then schedules it after that step's
        results rather than beside it (async scheduling). proposals_known: the drafter
        proposes only sometimes (ngram), so a request without drafts from its last results is
        taken to want none; otherwise every request is taken to have k."""
        for req in running:
            if req.num_tokens_with_pending - req.num_computed_tokens != 1:
                continue  # a prompt chunk next (or nothing: its last token is in flight)
            if req.spec_skip > 0 or (proposals_known and not req.spec_token_ids):
                continue  # its next decode step still backs off, or it has nothing to verify
            if req.spec_draft_limits and not any(req.spec_draft_limits):
                continue  # the step in flight drafts nothing for it (draft_limits)
            if req.structured is None and self._budget(req, self.k, len(running)) > 0:
                return True
        return False

    @staticmethod
    def not_verified(req: Request) -> None:
        """num_drafts granted drafts that the step then could not take (no free blocks for
        their slots): its counts aged as a verified step's move the rest of the way, as a
        step verifying none (age_counts); its draft limits, made for them, are dropped."""
        req.spec_draft_limits = ()
        req.spec_hits += PRIOR_HITS * (1.0 - ACCEPT_DECAY)
        req.spec_fails += PRIOR_FAILS * (1.0 - ACCEPT_DECAY)

    def settle(self, req: Request, num_drafts: int, accepted: int) -> None:
        """Counts a verified step of num_drafts drafts, `accepted` of them accepted, and
        updates the request's estimate and backoff."""
        self._drafts += 1
        self._draft_tokens += num_drafts
        self._accepted += accepted
        for pos in range(accepted):
            self._per_pos[pos] += 1
        for pos in range(min(num_drafts, self.k)):
            self._verified_pos[pos] += 1
        req.spec_hits += accepted
        req.spec_fails += accepted < num_drafts  # the first rejection; later drafts unseen
        if accepted:
            req.spec_misses = req.spec_backoffs = 0
            req.spec_ever_accepted = True
            return
        req.spec_misses += 1
        if backs_off_after(req.spec_misses, req.spec_hits, req.spec_fails,
                           req.spec_ever_accepted):
            self._back_off(req)

    @staticmethod
    def _back_off(req: Request) -> None:
        """After MISSES_BEFORE_BACKOFF misses in a row (drafts rejected, or skipped for low
        confidence), the request decodes without drafts for a while."""
        if req.spec_misses >= MISSES_BEFORE_BACKOFF:
            req.spec_skip = min(4 << req.spec_backoffs, MAX_BACKOFF_STEPS)
            req.spec_backoffs += 1

    def take_stats(self) -> dict:
        """vLLM's spec_decode counters since the last call (none: no verify step)."""
        if not self._drafts and not any(self._proposed_pos):
            return {}
        stats = dict(spec_num_drafts=self._drafts, spec_num_draft_tokens=self._draft_tokens,
                     spec_num_accepted_tokens=self._accepted,
                     spec_num_accepted_tokens_per_pos=self._per_pos,
                     spec_num_proposed_tokens_per_pos=self._proposed_pos,
                     spec_num_verified_tokens_per_pos=self._verified_pos)
        self._reset_stats()
        return stats
