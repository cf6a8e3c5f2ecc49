"""Speculative decoding with ngram drafts on the real SmolLM2-135M (CPU): tokens per target
step and wall-clock speedup over no speculation, in one run, on input-grounded prompts
(repeat / edit this code), greedy.

    .venv/bin/python benchmarks/spec_decode_cpu.py                 # full run
    .venv/bin/python benchmarks/spec_decode_cpu.py --smoke         # a quick check

Two engines live side by side (no speculation; ngram with k drafts). The machine is shared
and noisy, so the A/B runs are interleaved, in alternating order, --rounds times, for two
modes: each prompt alone (batch 1) and all prompts in one batch; every round's figures are
kept, and the speedup is given per round and as the median. Each run also checks that the
outputs with speculation are token for token those without (greedy is lossless).
"Tokens per target step": output tokens over the requests' rows in target forward passes
(a verify of k+1 positions counts once, as a decode step does).
Results: benchmarks/results/<date>-spec-decode-cpu.json."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import engine_internals
from bench_args import add_common
from results_file import cpu_model, default_path, record, write

from shoal import LLM, SamplingParams

SNIPPETS = [
    '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)
''',
    '''def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        mid = (low + high) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
''',
    '''import json

def save_scores(scores, path):
    data = {"scores": scores, "count": len(scores), "best": max(scores)}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)

def load_scores(path):
    with open(path) as f:
        return json.load(f)["scores"]
''',
    '''function fetchUser(id) {
  return fetch(`/api/users/${id}`)
    .then((response) => {
      if (!response.ok) {
        throw new Error(`request failed: ${response.status}`);
      }
      return response.json();
    })
    .then((user) => user.name);
}
''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
''',
    '''SELECT customers.name, COUNT(orders.id) AS num_orders, SUM(orders.total) AS spent
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY spent DESC;
''',
    '''def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        elif i % 5 == 0:
            print("Buzz")
        else:
            print(i)
''',
]
TASKS = [
    "Repeat this code exactly, in a code block:",
    "Rename the variables of this code to longer, clearer names and show the full code:",
    "Add a short comment above each line of this code and show the full code:",
    "Repeat this code exactly, in a code block:",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-prompts", type=int, default=len(SNIPPETS))
    add_common(p, rounds=2, out=None, smoke="2 prompts, 32 tokens, 1 round")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads per engine (1: a shared, busy machine does not make "
                        "spinning thread teams of it)")
    return p.parse_args()


class Counters:
    """Target forward passes of an engine: rows that sampled (a request in a step), plus the
    spec_decode counters, both read off the engine core."""

    def __init__(self, llm: LLM):
        core = engine_internals.core(llm, required=True)
        self.rows = self.steps = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        execute, stats = core.runner.execute, core.scheduler.stats

        def counted_execute(sched):
            if not sched.is_empty:
                self.steps += 1
                self.rows += sum(1 for it in sched.scheduled if it.sample)
            return execute(sched)

        def counted_stats():
            s = stats()
            self.drafts += s.spec_num_drafts
            self.draft_tokens += s.spec_num_draft_tokens
            self.accepted += s.spec_num_accepted_tokens
            return s
        core.runner.execute = counted_execute
        core.scheduler.stats = counted_stats

    def snapshot(self) -> tuple[int, ...]:
        return (self.rows, self.steps, self.drafts, self.draft_tokens, self.accepted)


def run(llm: LLM, counters: Counters, prompts: list[dict], sp: SamplingParams,
        batched: bool) -> tuple[dict[str, Any], list[list[int]]]:
    before = counters.snapshot()
    t0 = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    wall = time.perf_counter() - t0
    rows, steps, drafts, draft_tokens, accepted = (
        a - b for a, b in zip(counters.snapshot(), before))
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    fig = {"wall_s": round(wall, 3), "output_tokens": n_out,
           "output_tok_per_s": round(n_out / wall, 2), "target_steps": steps,
           "tokens_per_target_step": round(n_out / rows, 3)}
    if drafts:
        fig.update(num_drafts=drafts, num_draft_tokens=draft_tokens,
                   num_accepted_tokens=accepted,
                   draft_acceptance_rate=round(accepted / draft_tokens, 3),
                   mean_acceptance_length=round(1 + accepted / drafts, 3))
    return fig, tokens


def main() -> int:
    args = parse_args()
    if args.smoke:
        args.num_prompts, args.max_tokens, args.rounds = 2, 32, 1
    common = dict(max_model_len=2048, kv_cache_memory_bytes=256 << 20,
                  cpu_threads=args.cpu_threads)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_min": args.prompt_lookup_min,
                   "prompt_lookup_max": args.prompt_lookup_max}
    plain = LLM(**common)
    spec = LLM(**common, speculative_config=spec_config)
    engines = {"plain": (plain, Counters(plain)), "ngram": (spec, Counters(spec))}
    inputs = plain.llm_engine.inputs
    prompts = [{"prompt_token_ids": inputs.process_chat(
        [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{code}"}]).prompt_token_ids}
        for i, code in enumerate(SNIPPETS[:args.num_prompts])]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # Warm both once (first-call costs), outside the timings.
    for llm, _ in engines.values():
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    modes: dict[str, Any] = {}
    for mode, batched in (("batch_1", False), (f"batch_{len(prompts)}", True)):
        rounds = []
        for r in range(args.rounds):
            order = ["plain", "ngram"] if r % 2 == 0 else ["ngram", "plain"]
            got: dict[str, Any] = {}
            toks: dict[str, list[list[int]]] = {}
            for name in order:
                got[name], toks[name] = run(*engines[name], prompts, sp, batched)
                print(mode, r, name, got[name], flush=True)
            got["order"] = order
            got["identical_outputs"] = toks["plain"] == toks["ngram"]
            got["speedup"] = round(got["plain"]["wall_s"] / got["ngram"]["wall_s"], 3)
            rounds.append(got)
        modes[mode] = {
            "rounds": rounds,
            "speedup_median": statistics.median(r["speedup"] for r in rounds),
            "tokens_per_target_step": {
                "plain": rounds[0]["plain"]["tokens_per_target_step"],
                "ngram": rounds[0]["ngram"]["tokens_per_target_step"]},
            "identical_outputs": all(r["identical_outputs"] for r in rounds),
        }
    rec = record("spec-decode-cpu", "shoal", model="SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32)",
                 cpu=cpu_model(), cpu_count=os.cpu_count(), cpu_threads=args.cpu_threads,
                 load_avg_at_end=os.getloadavg(),
                 speculative_config=spec_config, max_tokens=args.max_tokens,
                 num_prompts=len(prompts), prompt_lens=[len(p["prompt_token_ids"])
                                                        for p in prompts],
                 modes=modes)
    write([rec], args.out or default_path("spec-decode", "cpu", smoke=args.smoke))
    return 0 if all(m["identical_outputs"] for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
