"""Write a Hugging Face folder (config, safetensors, tokenizer) from shoal's embedded GGUF.

Peer engines (vLLM's CPU build, transformers) cannot read the embedded Q4_1 GGUF the way shoal
does, so this dequantizes it with shoal's own loader and saves a plain float32 checkpoint:

    .venv/bin/python benchmarks/export_hf_folder.py [--out bench-work/smollm2-hf] [--check]
    .venv/bin/python benchmarks/export_hf_folder.py --shape qwen3-0.6b \
        --out bench-work/qwen3-0.6b-smol        # W8's model: no weights, ~3.5 MB

--check loads the folder with transformers and compares its greedy tokens with shoal.LLM's.
--shape writes no weights: a shipped shape's config.json (shoal/model_configs/<shape>) with
the vocabulary size and bos/eos ids of this model's tokenizer, and the tokenizer files: a
model for load_format="dummy" whose text tokenizes (W8, structured_outputs_gpu.py; carried
to the GPU machine with the run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench-work" / "smollm2-hf"
CHECK_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


def export(out: Path, model: str | None = None) -> Path:
    """Dequantize `model` (None = embedded SmolLM2) into `out`; returns `out`."""
    from shoal.loader import load_model

    t0 = time.perf_counter()
    m = load_model(model)
    if m.tokenizer is None:
        raise RuntimeError(f"{m.source} has no tokenizer to export")
    out.mkdir(parents=True, exist_ok=True)
    # Tensors must be contiguous and must not share storage for save_file.
    tensors = {name: t.detach().to(torch.float32).contiguous().clone() for name, t in m.weights()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    m.hf_config.save_pretrained(out)
    m.tokenizer.save_pretrained(out)
    meta = {"source": m.source, "load_format": m.load_format, "num_tensors": len(tensors)}
    (out / "shoal_export.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {len(tensors)} tensors to {out} in {time.perf_counter() - t0:.1f} s")
    return out


def export_shape(out: Path, shape: str, model: str | None = None) -> Path:
    """`shape`'s config with `model`'s (None = embedded SmolLM2) tokenizer, no weights."""
    from shoal.loader.tokenizers import load_tokenizer

    tok = load_tokenizer(model or "smollm2")
    cfg = json.loads((REPO / "shoal" / "model_configs" / shape / "config.json").read_text())
    cfg |= {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id}
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {shape}'s config (vocab {len(tok)}, eos {tok.eos_token_id}) and the "
          f"tokenizer to {out}")
    return out


def check(folder: Path, max_tokens: int = 24) -> bool:
    """Greedy tokens of transformers (float32, from `folder`) vs shoal.LLM (float32, GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shoal import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt_ids = [tok(p)["input_ids"] for p in CHECK_PROMPTS]
    hf_out: list[list[int]] = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            hf_out.append(g[0, len(ids):].tolist())

    llm = LLM(dtype="float32", max_model_len=2048)
    # The shoal tokenizer must agree with the exported one on these prompts.
    shoal_tok = llm.get_tokenizer()
    same_ids = all(shoal_tok(p)["input_ids"] == ids for p, ids in zip(CHECK_PROMPTS, prompt_ids))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp, use_tqdm=False)
    ok = same_ids
    print(f"tokenizer ids identical: {same_ids}")
    for p, h, o in zip(CHECK_PROMPTS, hf_out, outs):
        s = list(o.outputs[0].token_ids)
        n = next((i for i, (a, b) in enumerate(zip(h, s)) if a != b), min(len(h), len(s)))
        match = h == s
        ok &= match
        print(f"{'MATCH' if match else 'DIFF '} {p!r}: {n}/{len(h)} tokens agree; "
              f"hf={tok.decode(h)!r} shoal={tok.decode(s)!r}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--model", default=None, help="shoal model argument (default: embedded SmolLM2)")
    ap.add_argument("--check", action="store_true", help="compare greedy output with transformers")
    ap.add_argument("--skip-export", action="store_true", help="only --check an existing folder")
    ap.add_argument("--shape", default=None,
                    help="a folder name of shoal/model_configs: its config, this tokenizer")
    args = ap.parse_args()
    if args.shape:
        export_shape(args.out, args.shape, args.model)
    elif not args.skip_export:
        export(args.out, args.model)
    if args.check:
        return 0 if check(args.out) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
