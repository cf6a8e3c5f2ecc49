"""Accuracy of each quantized checkpoint format against bf16, on the embedded SmolLM2 (CPU).

The bf16 model (SmolLM2-135M-Instruct dequantized from its GGUF: export_hf_folder.py) writes
a greedy continuation of each prompt, 1,000 tokens in all. Each format's checkpoint is the
same weights quantized by the test suite's quantizers (tests/quantization/quant_cases.py:
group 32, since SmolLM2's 576-wide rows do not split into groups of 128); shoal loads it
(dequantized at load: shoal/quantization) and scores the bf16 model's own tokens
teacher-forced (prompt logprobs). Per format: the mean and the largest absolute difference
of those logprobs from bf16's, and how often its top-1 token is bf16's.

    .venv/bin/python benchmarks/quant_accuracy.py [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO / "tests" / "quantization")]

import results_file  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Write a short poem about autumn leaves.",
    "import numpy as np\n\n# compute the mean of each column\n",
    "The difference between a virus and a bacterium is",
    "Here is a recipe for a simple tomato soup:",
]
QUANTIZER = ("round to nearest, per group min-max (the test suite's quantizers): no GPTQ or AWQ "
             "calibration, so the INT4 rows are worse than real GPTQ/AWQ checkpoints")
FORMATS = ["fp8-block", "fp8-channel-static", "online-fp8", "ct-w8a8-fp8", "ct-w8a8-int8",
           "ct-w8a16-naive", "gptq-8bit-asym-v2", "gptq-4bit-g32", "gptq-4bit-act-order",
           "awq-4bit-g32", "ct-w4a16-sym", "ct-w4a16-asym"]


def _llm(folder: Path, quantization: str | None = None):
    from shoal import LLM

    return LLM(model=str(folder), tokenizer="smollm2", dtype="bfloat16",
               quantization=quantization, max_model_len=1024, enable_prefix_caching=False)


def _teacher_forced(llm, sequences: list[list[int]], starts: list[int]):
    """Per sequence: the logprob of each token from its start on, and whether it was top-1."""
    from shoal import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    lps, top1 = [], []
    for seq, start, out in zip(sequences, starts, outs):
        for pos in range(start, len(seq)):
            entry = out.prompt_logprobs[pos]
            lps.append(entry[seq[pos]].logprob)
            top1.append(entry[seq[pos]].rank == 1)
    return lps, top1


def run(tokens_per_prompt: int) -> dict:
    import quant_cases
    import quant_checkpoints as qc
    from export_hf_folder import export

    from shoal import SamplingParams
    from shoal.loader.tokenizers import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="quant-accuracy-"))
    dense = export(work / "bf16")
    tok = load_tokenizer("smollm2")
    prompts = [tok.encode(p) for p in PROMPTS]
    ref_llm = _llm(dense)
    greedy = SamplingParams(temperature=0, max_tokens=tokens_per_prompt, ignore_eos=True)
    outs = ref_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    starts = [len(p) for p in prompts]
    ref, ref_top1 = _teacher_forced(ref_llm, sequences, starts)
    del ref_llm
    results = {"bf16": {"tokens": len(ref), "top1_agreement": sum(ref_top1) / len(ref)}}
    for name in FORMATS:
        case = quant_cases.CASES[name]
        t0 = time.perf_counter()
        if case.quantize is None:  # online: the dense checkpoint, quantized at load
            folder = dense
        else:
            folder, _ = qc.quantize_folder(dense, work / name, case.quantize, case.config)
        llm = _llm(folder, case.quantization)
        lps, top1 = _teacher_forced(llm, sequences, starts)
        del llm
        diffs = [abs(a - b) for a, b in zip(lps, ref)]
        results[name] = {
            "tokens": len(diffs),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "max_abs_logprob_diff": max(diffs),
            "top1_agreement": sum(top1) / len(top1),  # its top-1 is bf16's greedy token
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"{name:22s} mean |dlogprob| {results[name]['mean_abs_logprob_diff']:.4f}  "
              f"max {results[name]['max_abs_logprob_diff']:.3f}  "
              f"top-1 agreement {results[name]['top1_agreement']:.3f}", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-per-prompt", type=int, default=125)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    formats = run(args.tokens_per_prompt)
    data = results_file.record(
        "quant-accuracy", "shoal", model="SmolLM2-135M-Instruct (bf16 from the embedded GGUF)",
        reference="bf16, teacher-forced on its own greedy continuation",
        quantizer=QUANTIZER,
        prompts=len(PROMPTS), tokens_per_prompt=args.tokens_per_prompt, formats=formats)
    out = args.out or results_file.default_path("quant-accuracy", results_file.hardware_label())
    print(results_file.write(data, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
