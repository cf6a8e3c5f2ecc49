"""W13, images (../shared/BENCHMARKS.md), on one GPU (written for an H200): the
Qwen2.5-VL-7B shape (shoal/model_configs/qwen2.5-vl-7b, load_format=dummy: random bf16), or
with --model Qwen/Qwen3-VL-8B-Instruct the Qwen3-VL-8B one (qwen3-vl-8b: videos with EVS);
neither folder has a tokenizer: offline prompts are token ids, and the server gets a
word-level tokenizer with Qwen's special-token ids (written here), so both sides run the same
prompts.

    python benchmarks/vl_gpu.py                         # every section -> $OUT/vl_gpu.json
    python benchmarks/vl_gpu.py --sections throughput,serve --out F
    python benchmarks/vl_gpu.py --sections evs --model Qwen/Qwen3-VL-8B-Instruct --out F
    python benchmarks/vl_gpu.py --smoke --out /tmp/vl.json   # CPU, a tiny random model (~35 s)

Sections (one record each; the file is rewritten after each):
- throughput: --num-requests (256), each its own seeded noise image of --image-size
  (1024x768) in a short chat prompt (the placeholder expanded by the processor), --output-len
  (128) tokens, ignore_eos, after 4 warm-up requests, --runs (2) times with new images (the
  last is the headline): images/s and output tok/s over the whole generate (the host's image
  preprocessing included) and over the engine's span (first arrival to last finish); the
  scheduler's encoder counters; the processor's host time per image.
- ttft: --ttft-pairs (16) times a new image, then the same image behind other text (an
  encoder cache hit, a prefix cache miss), then that prompt again (a prefix cache hit):
  TTFT of a max_tokens=1 request, wall and engine (first token - arrival), median and p90;
  num_encoded / num_hits deltas and num_cached_tokens per kind.
- encoder: model.embed_multimodal for one image (host arrays in), the tower alone on device
  tensors (with its plan made beforehand too) and --encoder-batch images in one call, CUDA
  events, median of --encoder-iters; the tower's CUDA graph (shoal/worker/encoder_graphs.py)
  where the tree has one, else a note; the FLOP floor at 791 TFLOP/s.
- evs: --evs-requests (5) noise videos of --video-frames (16) frames of --video-size
  (640x480), after one warm-up video, at each --evs-rates (0, 0.5) video_pruning_rate, one
  engine per rate: video tokens and TTFT (a max_tokens=1 request, median), each over rate
  0's; only where EngineArgs has video_pruning_rate, else a note. Qwen3-VL-8B: 16 frames at
  2 fps make 8 frame groups of 15 x 20 merged patches, 2400 video tokens (1200 at 0.5).
- serve: the throughput workload through `shoal serve` (same engine arguments), chat requests
  with data-URL images (--image-format png: lossless, the same pixels) from --concurrency (64)
  clients, the offline runs' images after 4 warm-up requests: images/s, output tok/s, each
  over the offline figure (last run over last run); the client's bodies are made before each
  run (PNG encoding is not timed), answers are non-streaming.
Each engine runs in a child process (this script with --child, vl_offline.py), so one's GPU
memory is free before the next starts. The server and the offline engines both get the
tokenizer (so both detokenize) and the same engine arguments. --smoke: a 2-layer random
Qwen2.5-VL (tests/vl_checkpoints.py; a 2-layer Qwen3-VL when --model is a Qwen3-VL) on the
CPU, every size tiny."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from results_file import REPO, default_path, record, write
from server_process import SHOAL_CLI, ServerProcess, free_port
from vl_offline import engine_kw, full_config, noise_image, run_child, seeds, size_of, words

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
SECTIONS = ("throughput", "ttft", "encoder", "evs", "serve")
OFFLINE = ("throughput", "ttft", "encoder")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                 "<|vision_start|>": 151652, "<|vision_end|>": 151653,
                 "<|image_pad|>": 151655, "<|video_pad|>": 151656}
# Qwen3-VL writes "<2.5 seconds>" before each frame group: split at punctuation into
# "<", "2", ".", "5", "seconds", ">" (Qwen's BPE makes six tokens of it too, for times under
# 10 s), at ids no prompt word (w4..w199) uses
TIMESTAMP_PIECES = ["<", ">", ".", "seconds", *(str(i) for i in range(1000))]
TIMESTAMP_FIRST_ID = 1000
SMOKE = dict(num_requests=4, output_len=8, image_size="224x168", ttft_pairs=2, encoder_iters=3,
             encoder_batch=2, video_frames=4, video_size="112x84", evs_requests=1,
             concurrency=2)


def qwen_word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (split at whitespace and punctuation) over Qwen-VL's ids:
    <unk>, user, assistant, system, w4..., the timestamp pieces from id 1000, and the special
    tokens at their real ids; the chat template above."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {i: s for s, i in QWEN_SPECIALS.items()}
    names |= {TIMESTAMP_FIRST_ID + k: piece for k, piece in enumerate(TIMESTAMP_PIECES)}
    vocab = {"<unk>": 0, "user": 1, "assistant": 2, "system": 3}
    vocab |= {names.get(i, f"w{i}"): i for i in range(4, max(names) + 1)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


# ---- the parent: children, the server, the file --------------------------------------------
def child(args: argparse.Namespace, kind: str, extra: list[str]
          ) -> tuple[list[dict[str, Any]], bool]:
    """This script with --child KIND in its own process: its records (what it wrote before a
    failure or the time limit), and whether it ended well."""
    out = args.work_dir / f"child-{kind}{'' if kind == 'offline' else extra[-1]}.json"
    cmd = [sys.executable, __file__, *sys.argv[1:], "--model", args.model, "--tokenizer-dir",
           str(args.tokenizer_dir), "--child", kind, "--child-out", str(out), *extra]
    t0 = time.perf_counter()
    try:
        rc: Any = subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = f"killed after {args.timeout} s"
    print(f"child {kind} {extra}: rc {rc}, {time.perf_counter() - t0:.1f} s", flush=True)
    got = json.loads(out.read_text()) if out.exists() else []
    if not got:
        got = [record(f"W13_{kind}", "shoal", error=f"child {extra} exited {rc}, no records")]
    return got, rc == 0 and not any("error" in r for r in got)


def serve_cli(args: argparse.Namespace) -> list[str]:
    """engine_kw as `shoal serve` flags."""
    return [x for k, v in engine_kw(args).items() for x in ("--" + k.replace("_", "-"), str(v))]


def data_url(seed: int, args: argparse.Namespace) -> str:
    buf = io.BytesIO()
    img = noise_image(seed, size_of(args.image_size))
    if args.image_format == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        img.save(buf, format="JPEG", quality=95)
    return f"data:image/{args.image_format};base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(args: argparse.Namespace, model: str, seed: int) -> bytes:
    parts = [{"type": "text", "text": words(seed)},
             {"type": "image_url", "image_url": {"url": data_url(seed, args)}},
             {"type": "text", "text": words(seed + 1)}]
    return json.dumps({"model": model, "messages": [{"role": "user", "content": parts}],
                       "max_tokens": args.output_len, "ignore_eos": True,
                       "temperature": args.temperature}).encode()


async def post_all(url: str, bodies: list[bytes], concurrency: int) -> tuple[list, float]:
    """Every body to /v1/chat/completions, `concurrency` at a time: (status, answer) each,
    and the wall time."""
    from shoal.benchmarks.http_client import HTTPClient

    client, gate = HTTPClient(url), asyncio.Semaphore(concurrency)

    async def one(body: bytes) -> tuple[int, Any]:
        async with gate:
            parts: list[bytes] = []
            resp = await client.request("POST", "/v1/chat/completions", body,
                                        sink=lambda b, _t: parts.append(b))
            raw = b"".join(parts)
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw[:500].decode(errors="replace")
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def bodies_of(args: argparse.Namespace, seed_list: list[int]) -> tuple[list[bytes], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 2)) as pool:
        bodies = list(pool.map(lambda s: chat_body(args, args.model, s), seed_list))
    return bodies, time.perf_counter() - t0


def served_run(url: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    bodies, encode_s = bodies_of(args, seeds(args, "throughput", args.num_requests, run))
    results, wall = asyncio.run(post_all(url, bodies, args.concurrency))
    ok = [r for status, r in results if status == 200]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
            "images_per_s": len(ok) / wall, "output_tok_s": out_tokens / wall,
            "total_output_tokens": out_tokens,
            "prompt_tokens_median": float(np.median([r["usage"]["prompt_tokens"] for r in ok]))
            if ok else None, "request_mb_mean": float(np.mean([len(b) for b in bodies])) / 2**20,
            "client_encode_s": encode_s,
            "first_error": next((r for s, r in results if s != 200), None)}


def serve(args: argparse.Namespace, offline: dict[str, Any] | None) -> dict[str, Any]:
    """The throughput workload through `shoal serve`: 4 warm-up requests, then --runs runs
    of the offline runs' images; the last run over the last offline run."""
    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "serve", args.model, "--tokenizer",
           str(args.tokenizer_dir), *serve_cli(args), "--port", str(port),
           "--disable-uvicorn-access-log"]
    with ServerProcess(cmd, port, log=args.work_dir / "server.log", timeout=args.timeout,
                       poll_s=0.5) as server:
        warm, _ = bodies_of(args, seeds(args, "warm", 4))
        asyncio.run(post_all(server.url, warm, len(warm)))
        runs = []
        for run in range(args.runs):
            runs.append(served_run(server.url, args, run))
            print(f"served run {run}: {json.dumps(runs[-1])[:400]}", flush=True)
    fig = {**runs[-1], "runs_images_per_s": [r["images_per_s"] for r in runs],
           "runs_output_tok_s": [r["output_tok_s"] for r in runs], "all_runs": runs,
           "server_ready_s": server.ready_s, "concurrency": args.concurrency,
           "image_format": args.image_format, "command": " ".join(["shoal", *cmd[3:]])}
    if offline:
        for key in ("images_per_s", "output_tok_s", "engine_images_per_s"):
            base = offline.get(key)
            fig[f"over_offline_{key}"] = fig[key.removeprefix("engine_")] / base if base else None
        fig["offline_prompt_tokens_median"] = offline.get("prompt_tokens_median")
    return record("W13_serve", "shoal", model=args.model, num_requests=args.num_requests,
                  image_size=args.image_size, output_len=args.output_len,
                  temperature=args.temperature, **fig)


def evs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    from dataclasses import fields

    from shoal.engine.engine_args import EngineArgs

    if "video_pruning_rate" not in {f.name for f in fields(EngineArgs)}:
        return [record("W13_evs", "shoal", skipped=True,
                       note="this tree's engine has no video_pruning_rate (EVS) yet")], True
    rates, ok = [], True
    for rate in args.evs_rates:  # one engine (process) per rate
        got, fine = child(args, "evs", ["--evs-rate", str(rate)])
        rates.append(got[0] | {"rate": rate})
        ok = ok and fine
    base = next((r for r in rates if r["rate"] == 0 and "video_tokens" in r), None)
    for r in rates:
        if base and "video_tokens" in r:
            r["tokens_over_rate0"] = r["video_tokens"] / base["video_tokens"]
            a, b = r["engine_ttft_ms_median"], base["engine_ttft_ms_median"]
            r["engine_ttft_over_rate0"] = a / b if a and b else None
    return [record("W13_evs", "shoal", model=args.model, video_frames=args.video_frames,
                   video_size=args.video_size, rates=rates)], ok


def parent(args: argparse.Namespace) -> int:
    """The model (smoke: a tiny random folder) and tokenizer in a scratch folder, removed at
    the end; then each section."""
    args.work_dir = Path(tempfile.mkdtemp(prefix="vl-gpu-"))
    try:
        if args.smoke:
            args.model = str(tiny_model(args.model, args.work_dir / "tiny"))
            args.tokenizer_dir = Path(args.model)
        else:
            args.tokenizer_dir = qwen_word_tokenizer(args.work_dir / "tokenizer")
        return sections(args)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)


def tiny_model(model: str, folder: Path) -> Path:
    """A tiny random checkpoint of `model`'s family (tests/vl_checkpoints.py): Qwen3-VL's
    when `model` is one (its videos have timestamps; EVS lays them out after the tower),
    else Qwen2.5-VL's."""
    sys.path.insert(0, str(REPO / "tests"))
    import vl_checkpoints

    if full_config(model).model_type == "qwen3_vl":
        return vl_checkpoints.write_tiny_qwen3_vl(folder)
    return vl_checkpoints.write_tiny_qwen2_5_vl(folder)


def sections(args: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    failed, offline = False, None
    offline_sections = ",".join(s for s in args.sections if s in OFFLINE)
    for section in dict.fromkeys("offline" if s in OFFLINE else s for s in args.sections):
        t0 = time.perf_counter()
        try:
            if section == "offline":
                got, ok = child(args, "offline", ["--offline-sections", offline_sections])
                offline = next((r for r in got if r["workload"] == "W13_throughput"), None)
            elif section == "evs":
                got, ok = evs(args)
            else:
                got, ok = [serve(args, offline)], True
        except Exception:
            traceback.print_exc()
            got, ok = [record(f"W13_{section}", "shoal", error=traceback.format_exc())], False
            log = args.work_dir / "server.log"
            if section == "serve" and log.exists():
                got[0]["server_log_tail"] = log.read_text()[-4000:]
        for r in got:
            r.setdefault("section_wall_s", time.perf_counter() - t0)
        records += got
        failed = failed or not ok
        write(records, args.out)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="all", help=f"all, or a comma list of {SECTIONS}")
    p.add_argument("--evs", action="store_true", help="add the evs section to --sections")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default $OUT/vl_gpu.json, else benchmarks/results/)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="headroom for the vision tower's activations beside the engine's")
    p.add_argument("--device", default=None, help="cpu: a check of the full path off the GPU")
    p.add_argument("--hf-overrides", default=None,
                   help='JSON config fields, e.g. {"num_hidden_layers": 1} (text layers)')
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=2, help="throughput runs, offline and served")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--image-size", default="1024x768")
    p.add_argument("--image-format", choices=("png", "jpeg"), default="png")
    p.add_argument("--ttft-pairs", type=int, default=16)
    p.add_argument("--encoder-iters", type=int, default=20)
    p.add_argument("--encoder-batch", type=int, default=8)
    p.add_argument("--video-frames", type=int, default=16)
    p.add_argument("--video-size", default="640x480")
    p.add_argument("--evs-rates", default="0,0.5")
    p.add_argument("--evs-requests", type=int, default=5,
                   help="timed videos per rate (new seeds; after one warm-up video)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=420, help="seconds per child or server")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, tiny sizes")
    # set by the parent for its children
    p.add_argument("--child", choices=("offline", "evs"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--offline-sections", default="", help=argparse.SUPPRESS)
    p.add_argument("--evs-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.dtype = "float32"
    args.sections = list(SECTIONS) if args.sections == "all" else [
        s.strip() for s in args.sections.split(",") if s.strip()]
    if args.evs and "evs" not in args.sections:
        args.sections.append("evs")
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    args.evs_rates = [float(x) for x in args.evs_rates.split(",") if x.strip()]
    args.runs = max(1, args.runs)
    if args.child:
        return run_child(args)
    if args.out is None:
        args.out = (Path(os.environ["OUT"], "vl_gpu.json") if os.environ.get("OUT")
                    else default_path("W13", smoke=args.smoke))
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
