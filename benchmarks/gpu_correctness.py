"""shoal against transformers on the GPU with the same random weights, for the Llama-3.1-8B
and Qwen3-0.6B shapes (full width, fewer layers so the check runs in seconds), in bfloat16
and float32: greedy tokens and last-position logprobs.

    python benchmarks/gpu_correctness.py --out correctness.json
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from bench_args import REQUIRED, add_common
from offline_runs import shipped_folder
from results_file import record, write
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams

SHAPES = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B", "qwen3-0.6b": "Qwen/Qwen3-0.6B",
          "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
          "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite"}
# Full-width MoE layers are large (64-128 experts): fewer of them keep the check fast.
# DeepSeek-V2-Lite: its dense first layer and one MoE layer.
LAYERS = {"qwen3-30b-a3b": 2, "deepseek-v2-lite": 2}


def hf_greedy(model, prompt: list[int], n: int, device: str) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt], device=device)
    out, logits, past = [], [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            last = res.logits[0, -1].float()
            logits.append(torch.log_softmax(last, -1).cpu())
            tok = int(last.argmax())
            out.append(tok)
            ids = torch.tensor([[tok]], device=device)
    return out, logits


def check(shape: str, dtype: torch.dtype, layers: int, steps: int, one_by_one: bool) -> dict:
    cfg = AutoConfig.from_pretrained(shipped_folder(SHAPES[shape]))
    layers = LAYERS.get(shape, layers)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    folder = tempfile.mkdtemp(prefix=f"shoal-{shape}-")
    hf.save_pretrained(folder, safe_serialization=True)
    name = str(dtype).removeprefix("torch.")
    llm = LLM(folder, dtype=name, max_model_len=1024, max_num_seqs=8,
              gpu_memory_utilization=0.3)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (5, 37, 128, 300)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    if one_by_one:  # each prompt alone: lone prefill chunks take the prefill graphs
        outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    exact, prefix, max_lp_diff = 0, [], 0.0
    for p, o in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf, p, steps, "cuda")
        got = o.outputs[0].token_ids
        n_same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), steps)
        prefix.append(n_same)
        exact += got == ref
        for i in range(n_same):  # logprob of the chosen token, while both agree
            mine = o.outputs[0].logprobs[i][got[i]].logprob
            max_lp_diff = max(max_lp_diff, abs(mine - ref_lp[i][got[i]].item()))
    del llm, hf
    torch.cuda.empty_cache()
    tol = 1e-3 if dtype == torch.float32 else 0.1
    ok = (exact == len(prompts) if dtype == torch.float32 else min(prefix) >= 1) and max_lp_diff < tol
    return record("correctness", "shoal", shape=shape, dtype=name, layers=layers, steps=steps,
                  one_by_one=one_by_one,
                  exact_matches=exact, prompts=len(prompts), agreeing_prefix=prefix,
                  max_logprob_diff=max_lp_diff, passed=bool(ok))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, out=REQUIRED)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--one-by-one", action="store_true",
                    help="generate each prompt alone (prefill graphs) instead of as a batch")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    records = []
    for shape in args.shapes:
        for dtype in (torch.bfloat16, torch.float32):
            try:
                r = check(shape, dtype, args.layers, args.steps, args.one_by_one)
            except Exception as e:  # report and go on: one failure must not hide the others
                r = record("correctness", "shoal", shape=shape, dtype=str(dtype), passed=False,
                           error=f"{type(e).__name__}: {e}")
            print(r, flush=True)
            records.append(r)
    write(records, args.out)


if __name__ == "__main__":
    main()
