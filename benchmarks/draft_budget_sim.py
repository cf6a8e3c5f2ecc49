"""Issue 38: the adaptive draft budget (shoal/engine/draft_budget.py) in a deterministic
simulation, costed with H100 step times of the Llama-3.1-8B shape (W9). No model runs: the
script drives the real DraftBudget exactly as the scheduler does, for N requests decoding in
lockstep, and adds up what their steps would cost.

    .venv/bin/python benchmarks/draft_budget_sim.py \
        --out benchmarks/results/2026-12-06-draft-budget-sim-cpu.json
    .venv/bin/python benchmarks/draft_budget_sim.py --batches 48 --rates 0.8 --rules current

The engine, per decode step (as engine/scheduler.py and engine/core.py with async scheduling):
every running request's `num_drafts(req, room, allowed, running)` is called once; `allowed` is
`wants_drafts(running)` asked before the step (when no request would verify, the step is
scheduled beside the one in flight, where no drafts can be verified); a request given n > 0
drafts is verified and `settle(req, n, accepted)` is called. After the step the drafter
proposes k drafts for every running request not backing off (spec_skip == 0: the runner
pauses the others' drafting). All N requests start together (the prefill step proposes for
all and is not counted) and produce 256 tokens each; a request that is done leaves the batch.

Acceptance (true per-draft acceptance a, seeded RNG per request):
  geometric: each verified draft is accepted with probability a once those before it were
    (the number accepted of j verified: leading successes of j draws).
  forced: W9's test_forced_acceptance rule (spec_decode/forced.py): floor(a * j + u) of j
    verified drafts, u uniform; it predicts the GPU benchmark.
Confidence (speculative_config confidence_threshold 0.5, or off):
  off: no probabilities (confidence-scheduled verification off).
  w9: every draft's probability is reported as a (what W9's forced overlay reports).
  calibrated: each draft's probability p_i ~ Beta(a*C, (1-a)*C), C = 4 (mean a, standard
    deviation sqrt(a(1-a)/5): 0.18 at a = 0.8), and the draft is accepted with probability
    p_i once those before it were: the probabilities are informative and calibrated, the
    mean acceptance is a (a in {0, 1}: p_i = a). Not run with `forced` acceptance, whose
    outcome does not depend on the probabilities (it would be w9's).

Cost model (ms; H100, Llama-3.1-8B bf16; plain decode steps of W9: 6.05 at batch 1, 6.71 at
batch 32, so 0.0213 ms a token in the step):
  a step of T tokens (running requests + drafts verified) costs 6.05 + 0.0213 * (T - 1),
    linear at every T (W9's verify steps of 160 tokens, batch 32 at a = 1: 8.8 ms measured,
    9.4 modelled; past ~256 tokens an 8B step is compute-bound at about the same slope, 16
    GFLOP a token, so no knee is modelled);
  a step in which the drafter proposes for m >= 1 requests costs 0.3 + 0.6 * (m - 1) / 31 ms
    more (0.3 ms at 1, 0.9 ms at 32; drafts skipped for low confidence were proposed, so
    they are paid for; --drafter-ms changes the two figures);
  plain decoding: 256 steps of 6.05 + 0.0213 * (B - 1) ms, no drafter.
Not modelled (--verify-overhead-ms adds a cost to each step that verifies, for a
sensitivity check; W9 at batch 1, a = 1: a verify step measured ~0.4 ms over this model):
the pipelining a step without drafts gets with async scheduling (a verify step runs one at a
time: the host's scheduling is not hidden), the rejection sampler, prefill, the drafter's
catch-up of paused rows, attention costs growing with the context. ratio = plain time /
simulated time (> 1: speculation pays), as W9's speedup. Lockstep, as W9: a request that
gains tokens shortens the run only once every request has, so drafts that pay for a few
requests at a time count for little.

Rules compared: "session12", the rule before issue 38's fix (reproduced here as a subclass:
the counts decayed toward 0 on every decode step not backing off, verified or not, and the
worth threshold's linear ramp to 0.9 at 64 requests); "current", the module's DraftBudget;
"aging_only", the current aging of the counts with the old ramp (what the threshold's
change adds). Output: one JSON record (results_file.record) with a row per (acceptance,
confidence, rule, batch, a), means over ceil(--requests-per-point / batch) runs."""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench_args import comma_floats, comma_ints, comma_words
from results_file import record, write

from shoal.core.request import Request
from shoal.engine import draft_budget
from shoal.engine.draft_budget import DraftBudget
from shoal.sampling_params import SamplingParams

K = 4
OUTPUT_LEN = 256
CONFIDENCE = 0.5
BETA_CONCENTRATION = 4.0
REQUESTS_PER_POINT = 128  # runs per point: ceil(this / batch), seeds 0, 1, ...
ACCEPTANCE_MODELS = ("geometric", "forced")
CONFIDENCE_MODELS = ("off", "w9", "calibrated")


@dataclass(frozen=True)
class CostModel:
    """Step times in ms (the module's docstring)."""
    step_batch1_ms: float = 6.05
    step_batch32_ms: float = 6.71
    drafter_batch1_ms: float = 0.3
    drafter_batch32_ms: float = 0.9
    verify_overhead_ms: float = 0.0  # a step that verifies drafts (0: not modelled)

    def step_ms(self, tokens: int) -> float:
        per_token = (self.step_batch32_ms - self.step_batch1_ms) / 31
        return self.step_batch1_ms + per_token * (tokens - 1)

    def drafter_ms(self, requests: int) -> float:
        if requests <= 0:
            return 0.0
        per_request = (self.drafter_batch32_ms - self.drafter_batch1_ms) / 31
        return self.drafter_batch1_ms + per_request * (requests - 1)


def ramp_threshold(running: int) -> float:
    """The worth threshold before issue 38's fix: MIN_WORTH up to DRAFT_COST_FREE_BATCH, then
    linear to MAX_WORTH at DRAFT_COST_FULL_BATCH (0.9 at 64)."""
    span = draft_budget.DRAFT_COST_FULL_BATCH - draft_budget.DRAFT_COST_FREE_BATCH
    x = min(max(running - draft_budget.DRAFT_COST_FREE_BATCH, 0) / span, 1.0)
    return draft_budget.MIN_WORTH + x * (draft_budget.MAX_WORTH - draft_budget.MIN_WORTH)


class RampBudget(DraftBudget):
    """The fixed aging with the worth threshold before the fix (the ramp to 0.9 at 64), and
    the backoff before the first-hit rule (every request as one with an accepted draft)."""

    def settle(self, req: Request, num_drafts: int, accepted: int) -> None:
        req.spec_ever_accepted = True
        super().settle(req, num_drafts, accepted)

    def _budget(self, req: Request, k: int, running: int) -> int:
        cap = self.disable_by_batch_size
        if cap is not None and running >= cap:
            return 0
        return draft_budget.adaptive_num_drafts(req.spec_hits, req.spec_fails, k,
                                                ramp_threshold(running))


class Session12Budget(RampBudget):
    """The rule before issue 38's fix: every decode step not backing off decays both counts
    toward 0, verified or not (an unverified request's estimate drifts to 0.5), a step
    backing off leaves them as they are, and the ramp threshold."""

    def num_drafts(self, req: Request, room: int, allowed: bool, running: int) -> int:
        if req.spec_skip > 0:
            req.spec_skip -= 1
            return 0
        req.spec_hits *= draft_budget.ACCEPT_DECAY
        req.spec_fails *= draft_budget.ACCEPT_DECAY
        return self._verified_drafts(req, room, allowed, running)


RULES: dict[str, type[DraftBudget]] = {"session12": Session12Budget, "current": DraftBudget,
                                       "aging_only": RampBudget}


@dataclass(frozen=True)
class Point:
    acceptance: str
    confidence: str
    rule: str
    batch: int
    a: float


@dataclass
class Outcome:
    """Means over the point's runs."""
    steps: float  # decode steps until every request is done
    verify_steps: float  # steps in which some request verified drafts
    request_verify_steps: float  # per request: its steps that verified drafts
    drafts_verified: float  # per request
    drafts_accepted: float  # per request
    proposing_steps: float  # per request: steps after which its drafter proposed
    time_ms: float
    plain_ms: float
    ratio: float  # plain_ms / time_ms


class SimRequest:
    """One request and its seeded draws."""

    def __init__(self, index: int, seed: int):
        self.req = Request(f"r{index}", [1, 2, 3], SamplingParams(max_tokens=OUTPUT_LEN),
                           frozenset(), OUTPUT_LEN, arrival_time=0.0)
        self.rng = random.Random(seed * 1_000_003 + index)
        self.verify_steps = self.verified = self.accepted = self.proposals = 0

    @property
    def done(self) -> bool:
        return self.req.num_output_tokens >= OUTPUT_LEN

    def propose(self, point: Point) -> None:
        """The drafter's k drafts for the next step, with their probabilities."""
        self.req.spec_token_ids = [7] * K
        self.req.spec_probs = [self._prob(point) for _ in range(K)]
        self.proposals += 1

    def _prob(self, point: Point) -> float:
        a = point.a
        if point.confidence != "calibrated" or a in (0.0, 1.0):
            return a
        return self.rng.betavariate(a * BETA_CONCENTRATION, (1 - a) * BETA_CONCENTRATION)

    def accept(self, point: Point, n: int) -> int:
        """How many of the n verified drafts are accepted."""
        if point.acceptance == "forced":
            return min(n, int(point.a * n + self.rng.random()))
        probs = (self.req.spec_probs if point.confidence == "calibrated"
                 else [point.a] * n)
        accepted = 0
        while accepted < n and self.rng.random() < probs[accepted]:
            accepted += 1
        return accepted

    def advance(self, tokens: int) -> None:
        new = [7] * min(tokens, OUTPUT_LEN - self.req.num_output_tokens)
        self.req.output_token_ids.extend(new)
        self.req.all_token_ids.extend(new)
        self.req.num_computed_tokens = self.req.num_tokens - 1  # its next step: one token


def run_once(point: Point, seed: int, cost: CostModel) -> dict[str, float]:
    budget = RULES[point.rule](K, 100_000, confidence=None if point.confidence == "off"
                               else CONFIDENCE)
    reqs = [SimRequest(i, seed) for i in range(point.batch)]
    for r in reqs:
        r.advance(0)
        r.propose(point)  # the prefill step's proposals
    steps = verify_steps = 0
    time_ms = 0.0
    while True:
        running = [r for r in reqs if not r.done]
        if not running:
            break
        allowed = budget.wants_drafts([r.req for r in running], False)
        verified = 0
        for r in running:
            n = budget.num_drafts(r.req, 1 << 20, allowed, len(running))
            r.req.spec_token_ids = []  # used now, or stale after the step
            accepted = 0
            if n:
                accepted = r.accept(point, n)
                budget.settle(r.req, n, accepted)
                r.verify_steps += 1
                r.verified += n
                r.accepted += accepted
                verified += n
            r.advance(1 + accepted)
        proposing = 0
        for r in running:
            if not r.done and r.req.spec_skip == 0:
                r.propose(point)
                proposing += 1
        time_ms += cost.step_ms(len(running) + verified) + cost.drafter_ms(proposing)
        time_ms += cost.verify_overhead_ms if verified else 0.0
        steps += 1
        verify_steps += verified > 0
    n = len(reqs)
    return {"steps": steps, "verify_steps": verify_steps,
            "request_verify_steps": sum(r.verify_steps for r in reqs) / n,
            "drafts_verified": sum(r.verified for r in reqs) / n,
            "drafts_accepted": sum(r.accepted for r in reqs) / n,
            "proposing_steps": sum(r.proposals for r in reqs) / n, "time_ms": time_ms}


def simulate(point: Point, cost: CostModel, requests_per_point: int = REQUESTS_PER_POINT
             ) -> Outcome:
    runs = [run_once(point, seed, cost)
            for seed in range(max(1, math.ceil(requests_per_point / point.batch)))]
    mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
    plain_ms = OUTPUT_LEN * cost.step_ms(point.batch)
    return Outcome(**mean, plain_ms=plain_ms, ratio=plain_ms / mean["time_ms"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the results (default: print)")
    p.add_argument("--batches", type=comma_ints, default=[1, 32, 48, 64])
    p.add_argument("--rates", type=comma_floats, default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--rules", type=comma_words, default=list(RULES))
    p.add_argument("--acceptance", type=comma_words, default=list(ACCEPTANCE_MODELS))
    p.add_argument("--confidence", type=comma_words, default=list(CONFIDENCE_MODELS))
    p.add_argument("--drafter-ms", type=comma_floats, default=[0.3, 0.9],
                   help="the drafter's cost of a step at batch 1 and 32, ms (0,0: a free "
                        "drafter, as W9's forced method)")
    p.add_argument("--verify-overhead-ms", type=float, default=0.0,
                   help="extra cost of a step that verifies drafts, ms (sensitivity: the "
                        "pipelining such a step loses; 0: not modelled)")
    p.add_argument("--requests-per-point", type=int, default=REQUESTS_PER_POINT,
                   help="runs per point: ceil(this / batch)")
    args = p.parse_args(argv)
    for name, values, allowed in (("--rules", args.rules, RULES),
                                  ("--acceptance", args.acceptance, ACCEPTANCE_MODELS),
                                  ("--confidence", args.confidence, CONFIDENCE_MODELS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"{name}: {bad} not in {list(allowed)}")
    if any(not 0.0 <= a <= 1.0 for a in args.rates):
        p.error("--rates: each in [0, 1]")
    if len(args.drafter_ms) != 2 or min(args.drafter_ms) < 0 or args.verify_overhead_ms < 0:
        p.error("--drafter-ms: two values >= 0; --verify-overhead-ms: >= 0")
    if any(b < 1 for b in args.batches) or args.requests_per_point < 1:
        p.error("--batches and --requests-per-point: each >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cost = CostModel(drafter_batch1_ms=args.drafter_ms[0], drafter_batch32_ms=args.drafter_ms[1],
                     verify_overhead_ms=args.verify_overhead_ms)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for acceptance in args.acceptance:
        for confidence in args.confidence:
            if acceptance == "forced" and confidence == "calibrated":
                continue  # (see the docstring)
            for batch in args.batches:
                for a in args.rates:
                    for rule in args.rules:
                        point = Point(acceptance, confidence, rule, batch, a)
                        out = simulate(point, cost, args.requests_per_point)
                        rows.append({**asdict(point), **{k: round(v, 3) for k, v in
                                                          asdict(out).items()}})
                        print(f"{acceptance:9} conf={confidence:10} {rule:9} B={batch:3} "
                              f"a={a:.1f} steps={out.steps:6.1f} "
                              f"verify={out.verify_steps:6.1f} ratio={out.ratio:.3f}",
                              flush=True)
    res = record("draft-budget-sim", "shoal", k=K, output_len=OUTPUT_LEN,
                 confidence_threshold=CONFIDENCE, beta_concentration=BETA_CONCENTRATION,
                 requests_per_point=args.requests_per_point, cost_model=asdict(cost),
                 sim_seconds=round(time.perf_counter() - t0, 1),
                 notes="simulated, no model runs: see benchmarks/draft_budget_sim.py's "
                       "docstring for the acceptance, confidence and cost models; "
                       "ratio = plain time / simulated time", rows=rows)
    if args.out:
        write(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
