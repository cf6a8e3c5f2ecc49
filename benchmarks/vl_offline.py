"""vl_gpu.py's workload (seeded noise images and videos in short chat prompts, as token ids)
and its engine-side sections, run in a child process per engine: throughput, ttft and
encoder on one engine, or one EVS rate (see vl_gpu.py for what each measures)."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any

import engine_internals as ei
import numpy as np
import offline_runs
from results_file import record, write

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
H200_BF16_FLOPS = 791e12  # BENCHMARKS.md: the H200's measured bf16 matrix product rate


# ---- the workload (the served section builds the same prompts from the same seeds) ---------
def size_of(text: str) -> tuple[int, int]:
    w, h = (int(x) for x in text.lower().split("x"))
    return w, h


def noise_image(seed: int, size: tuple[int, int]) -> Any:
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def words(seed: int, n: int = 8) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{k}" for k in rng.integers(4, 200, n))


def content(seed: int, placeholder: str) -> str:
    """A user turn's text as the server renders chat parts: text, the item, text."""
    return "\n".join([words(seed), placeholder, words(seed + 1)])


def prompt_ids(tok: Any, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def seeds(args: argparse.Namespace, kind: str, n: int, run: int = 0) -> list[int]:
    """Distinct images for each kind of request, and for each throughput run."""
    base = {"throughput": run * n, "warm": 50_000, "ttft": 60_000, "video": 70_000}[kind]
    return [args.seed * 100_000 + base + i for i in range(n)]


def image_request(tok: Any, seed: int, size: tuple[int, int], text_seed: int | None = None
                  ) -> dict[str, Any]:
    ids = prompt_ids(tok, content(seed if text_seed is None else text_seed, IMAGE))
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": noise_image(seed, size)}}


def full_config(model: str) -> Any:
    from shoal.loader.resolve import resolve_model
    from shoal.loader.safetensors_loader import load_folder_config

    return load_folder_config(resolve_model(model).path)


def processor(model: str) -> Any:
    from shoal.loader.resolve import resolve_model
    from shoal.multimodal.processors import processor_class

    cfg = full_config(model)
    arch = next(a for a in cfg.architectures if processor_class(a) is not None)
    return processor_class(arch)(resolve_model(model).path, cfg, None)


def counters(llm: Any) -> tuple[int, int] | None:
    """(images encoded, encoder cache hits) since start-up: the scheduler's books."""
    enc = getattr(getattr(ei.core(llm), "scheduler", None), "encoders", None)
    return None if enc is None else (enc.num_encoded, enc.num_hits)


def delta(c0: Any, c1: Any) -> dict[str, int | None]:
    if c0 is None or c1 is None:
        return {"encoded": None, "hits": None}
    return {"encoded": c1[0] - c0[0], "hits": c1[1] - c0[1]}


def stats(values: list[float]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "p90": None}
    return {"median": float(np.median(v)), "p90": float(np.percentile(v, 90))}


def timed(fn: Any, iters: int, warmup: int = 3) -> dict[str, Any]:
    """Milliseconds of fn: CUDA events around each call on a GPU, else the host clock."""
    import torch

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": float(np.median(times)), "min_ms": min(times), "max_ms": max(times),
            "iters": iters, "timer": "cuda events" if cuda else "host clock"}


# ---- sections --------------------------------------------------------------------------------
def generate_run(llm: Any, reqs: list[dict[str, Any]], sp: Any, image_id: int
                 ) -> dict[str, Any]:
    """One generate over every request: over its wall time (the host's image preprocessing
    included) and over the engine's span (first arrival to last finish)."""
    c0, t0 = counters(llm), time.perf_counter()
    outs = llm.generate(reqs, sp, use_tqdm=False)
    wall, c1 = time.perf_counter() - t0, counters(llm)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    m = [o.metrics for o in outs if o.metrics is not None and o.metrics.finished_time]
    engine_s = (max(x.finished_time for x in m) - min(x.arrival_time for x in m)) if m else None
    return {"wall_s": wall, "images_per_s": len(reqs) / wall, "output_tok_s": n_out / wall,
            "total_output_tokens": n_out, "engine_s": engine_s,
            "engine_images_per_s": len(reqs) / engine_s if engine_s else None,
            "engine_output_tok_s": n_out / engine_s if engine_s else None,
            "image_tokens_per_request": stats([o.prompt_token_ids.count(image_id)
                                               for o in outs]),
            "prompt_tokens_median": float(np.median([len(o.prompt_token_ids) for o in outs])),
            "encoder_counters": delta(c0, c1)}


def throughput(llm: Any, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    """--runs generates of --num-requests new images each (after 4 warm-up requests): the
    last is the headline, the first shows what warm-up is left."""
    from shoal import SamplingParams

    size, image_id = size_of(args.image_size), int(full_config(args.model).image_token_id)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                        ignore_eos=True)
    llm.generate([image_request(tok, s, size) for s in seeds(args, "warm", 4)], sp,
                 use_tqdm=False)
    runs = []
    for run in range(args.runs):
        reqs = [image_request(tok, s, size)
                for s in seeds(args, "throughput", args.num_requests, run)]
        runs.append(generate_run(llm, reqs, sp, image_id))
        print(f"run {run}: {json.dumps(runs[-1])}", flush=True)
    proc = processor(args.model)
    t1 = time.perf_counter()
    for r in reqs[:8]:
        proc.process(r["prompt_token_ids"], [r["multi_modal_data"]["image"]])
    pre_ms = (time.perf_counter() - t1) * 1e3 / min(8, len(reqs))
    return record("W13_throughput", "shoal", model=args.model, num_requests=len(reqs),
                  image_size=args.image_size, output_len=args.output_len,
                  temperature=args.temperature, **runs[-1],
                  runs_images_per_s=[r["images_per_s"] for r in runs],
                  runs_output_tok_s=[r["output_tok_s"] for r in runs], all_runs=runs,
                  host_preprocess_ms_per_image=pre_ms)


def one_request(llm: Any, req: dict[str, Any], sp: Any) -> tuple[dict[str, Any], Any]:
    c0, t0 = counters(llm), time.perf_counter()
    out = llm.generate(req, sp, use_tqdm=False)[0]
    wall, c1 = time.perf_counter() - t0, counters(llm)
    m = out.metrics
    eng = (m.first_token_time - m.arrival_time) * 1e3 if m and m.first_token_time else None
    return {"wall_ms": wall * 1e3, "engine_ms": eng, "cached_tokens": out.num_cached_tokens,
            **delta(c0, c1)}, out


def ttft(llm: Any, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    """Per seed: a new image; the same image behind other words (the prefix cache misses
    from the first block); that prompt again (the prefix cache holds it all)."""
    from shoal import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    size, warm, rows = size_of(args.image_size), 2, []
    for i, s in enumerate(seeds(args, "ttft", args.ttft_pairs + warm)):
        new = image_request(tok, s, size)
        hit = image_request(tok, s, size, text_seed=s + 7_777)
        row = {"seed": s}
        for kind, req in (("new", new), ("hit", hit), ("repeat", hit)):
            row[kind], _ = one_request(llm, req, sp)
        if i >= warm:
            rows.append(row)
    summary = {f"{kind}_{clock}_ms": stats([r[kind][f"{clock}_ms"] for r in rows])
               for kind in ("new", "hit", "repeat") for clock in ("wall", "engine")}
    totals = {kind: {k: sum(r[kind][k] or 0 for r in rows) for k in ("encoded", "hits")}
              for kind in ("new", "hit", "repeat")}
    new, hit = summary["new_engine_ms"]["median"], summary["hit_engine_ms"]["median"]
    return record("W13_ttft_cache", "shoal", model=args.model, image_size=args.image_size,
                  pairs=len(rows), **summary, counter_totals=totals,
                  hit_over_new_engine_median=hit / new if new and hit else None, rows=rows)


def tower_tflop(visual: Any, vision_cfg: Any, patches: int) -> float | None:
    """Matmul and attention FLOPs of the tower for one image of `patches` patches."""
    try:
        block = sum(p.numel() for p in visual.blocks.parameters() if p.dim() > 1)
        merger = sum(p.numel() for p in visual.merger.parameters() if p.dim() > 1)
        embed = sum(p.numel() for p in visual.patch_embed.parameters())
    except AttributeError:
        return None
    d, depth = int(vision_cfg.hidden_size), int(vision_cfg.depth)
    full = len(getattr(vision_cfg, "fullatt_block_indexes", None) or [])
    window = (int(getattr(vision_cfg, "window_size", 112)) // int(vision_cfg.patch_size)) ** 2
    merge = int(vision_cfg.spatial_merge_size) ** 2
    linear = 2 * patches * (block + embed) + 2 * patches // merge * merger
    attention = 4 * d * (full * patches ** 2 + (depth - full) * patches * min(window, patches))
    return (linear + attention) / 1e12


def _main_output(x: Any) -> Any:
    """The tower's main features (Qwen3-VL's tower also returns its deepstack features)."""
    return x[0] if isinstance(x, (tuple, list)) else x


def encoder_graph(llm: Any, visual: Any, pix: Any, grid: Any, eager: Any, iters: int
                  ) -> dict[str, Any]:
    """The tower replayed as a CUDA graph (shoal/worker/encoder_graphs.py) on the same image,
    and whether the engine's runner uses such graphs itself."""
    import torch

    try:
        from shoal.worker.encoder_graphs import EncoderGraphs
    except ImportError:
        return {"graph_note": "no encoder CUDA graph yet (shoal/worker/encoder_graphs.py)"}
    # the runner hands the model its graphs at capture (worker/graph_capture.py); the
    # engine replays them when one image is encoded at a time
    run = ei.runner(llm)
    model_graphs = getattr(getattr(run, "model", None), "encoder_graphs", None)
    wired = isinstance(model_graphs, EncoderGraphs) if run is not None else None
    if wired:
        wired = {"captured_grids": len(model_graphs.graphs),
                 "engine_replays": model_graphs.num_replays}
    if not torch.cuda.is_available() or not hasattr(visual, "forward_planned"):
        return {"graph_note": "encoder CUDA graphs need CUDA and a planned tower",
                "engine_uses_encoder_graphs": wired}
    try:
        graphs = EncoderGraphs(visual, pix.device)
        key = tuple(int(x) for x in grid.reshape(-1).tolist())
        out = graphs.run(pix, key)
        out, ref = _main_output(out), _main_output(eager)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        return {"graph_tower": timed(lambda: graphs.run(pix, key), iters),
                "graph_vs_eager_rel_err": err, "engine_uses_encoder_graphs": wired}
    except Exception:
        return {"graph_error": traceback.format_exc()[-2000:],
                "engine_uses_encoder_graphs": wired}


def encoder(llm: Any, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    import torch

    model = getattr(ei.runner(llm), "model", None)
    visual = getattr(model, "visual", None)
    if visual is None:
        return record("W13_encoder_step", "shoal", skipped=True,
                      note="the model is not reachable (SHOAL_BENCH_PUBLIC_ONLY or another tree)")
    proc, size, n = processor(args.model), size_of(args.image_size), args.encoder_iters
    feats = [proc.process(prompt_ids(tok, content(s, IMAGE)), [noise_image(s, size)])[1][0]
             for s in seeds(args, "warm", max(1, args.encoder_batch))]
    dev = next(model.parameters()).device
    arrays = [f.arrays() for f in feats]
    pixels = [torch.from_numpy(a["pixel_values"].copy()).to(dev) for a in arrays]
    grids = [torch.from_numpy(np.asarray(a["image_grid_thw"]).reshape(1, 3).copy())
             for a in arrays]
    pix, grid, batch = pixels[0], grids[0], len(feats)
    fig: dict[str, Any] = {"patches": int(pix.shape[0]), "image_tokens": feats[0].num_embeds}
    with torch.inference_mode():
        fig["embed_multimodal"] = timed(lambda: model.embed_multimodal(feats[:1]), n)
        fig["eager_tower"] = timed(lambda: visual(pix, grid), n)
        if hasattr(visual, "plan"):
            plan = visual.plan(grid)
            fig["eager_tower_planned"] = timed(lambda: visual.forward_planned(pix, plan), n)
        pix_b, grid_b = torch.cat(pixels), torch.cat(grids)
        fig[f"eager_tower_batch{batch}"] = timed(lambda: visual(pix_b, grid_b), n)
        fig["eager_tower_per_image_in_batch_ms"] = (
            fig[f"eager_tower_batch{batch}"]["median_ms"] / batch)
        fig |= encoder_graph(llm, visual, pix, grid, visual(pix, grid), n)
    vcfg = full_config(args.model).vision_config
    tflop = tower_tflop(visual, vcfg, fig["patches"])
    floor = tflop * 1e15 / H200_BF16_FLOPS if tflop else None
    fig |= {"tower_tflop_per_image": tflop, "tower_floor_ms_at_791_tflops": floor,
            "eager_tower_over_floor": fig["eager_tower"]["median_ms"] / floor if floor else None}
    return record("W13_encoder_step", "shoal", model=args.model, image_size=args.image_size,
                  dtype=str(visual.dtype), encoder_batch=batch, **fig)


def evs_rate(llm: Any, args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    from shoal import SamplingParams

    w, h = size_of(args.video_size)
    video_id = int(full_config(args.model).video_token_id)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for i, s in enumerate(seeds(args, "video", 1 + args.evs_requests)):  # the first: warm-up
        frames = np.random.default_rng(s).integers(0, 256, (args.video_frames, h, w, 3),
                                                   dtype=np.uint8)
        req = {"prompt_token_ids": prompt_ids(tok, content(s, VIDEO)),
               "multi_modal_data": {"video": frames}}
        row, out = one_request(llm, req, sp)
        row |= {"video_tokens": out.prompt_token_ids.count(video_id),
                "prompt_tokens": len(out.prompt_token_ids)}
        if i:
            rows.append(row)
    return {"rate": args.evs_rate, "video_tokens": rows[0]["video_tokens"],
            "prompt_tokens": rows[0]["prompt_tokens"], "requests": len(rows),
            "engine_ttft_ms_median": stats([r["engine_ms"] for r in rows])["median"],
            "wall_ttft_ms_median": stats([r["wall_ms"] for r in rows])["median"], "rows": rows}


def engine_kw(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of every engine here, offline and served (vl_gpu.serve_cli)."""
    kw: dict[str, Any] = dict(load_format="dummy", dtype=args.dtype,
                              max_model_len=1024 if args.smoke else args.max_model_len)
    if args.smoke or args.device == "cpu":
        kw |= dict(device="cpu", kv_cache_memory_bytes=(64 if args.smoke else 1024) << 20)
    else:
        kw |= dict(gpu_memory_utilization=args.gpu_memory_utilization)
    if args.hf_overrides:
        kw["hf_overrides"] = args.hf_overrides
    return kw


def run_child(args: argparse.Namespace) -> int:
    """One engine: the offline sections named in --offline-sections, or one EVS rate; the
    records (or the rate's figures) go to --child-out after each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.tokenizer_dir))
    kw = engine_kw(args) | ({"video_pruning_rate": args.evs_rate} if args.child == "evs" else {})
    eng = offline_runs.start_engine(args.model, tokenizer=str(args.tokenizer_dir), **kw)
    if args.child == "evs":
        write([evs_rate(eng.llm, args, tok) | {"ready_s": eng.ready_s}], args.child_out)
        return 0
    records, failed = [], False
    for section in args.offline_sections.split(","):
        t0 = time.perf_counter()
        try:
            rec = globals()[section](eng.llm, args, tok)
        except Exception:
            traceback.print_exc()
            rec, failed = record(f"W13_{section}", "shoal", error=traceback.format_exc()), True
        rec |= {"engine_ready_s": eng.ready_s, "section_wall_s": time.perf_counter() - t0}
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if "_s" in k or "ms" in k},
                         default=str)[:600], flush=True)
        write(records, args.child_out)
    return 1 if failed else 0
