"""A full weight update through the trainer's process group (issue 37's last must-show): a
trainer process, rank 0 of a group of 2, broadcasts every weight of the Llama-3.1-8B shape
(16 GB in bf16, under the checkpoint's names) and the engine, rank 1, takes them with
LLM.init_weight_update_group / update_weights_from_group. NCCL with the engine on cuda:0 and
the trainer on cuda:1 (NCCL refuses two ranks on one GPU, so this needs two); gloo on the CPU
with --smoke (a tiny random Llama).

Recorded: the update's seconds (the engine's update_weights_from_group call, the trainer
already waiting), bytes and GB/s; whether the engine's weights are the trainer's afterwards
(the float64 sum of every parameter against the trainer's sum of what it sent); the tokens
before and after (they differ: the trainer sends its own random weights).

    python benchmarks/rl_group_update.py --out bench-work/rl-group.json    # two GPUs
    python benchmarks/rl_group_update.py --smoke --out /tmp/rl-group.json  # CPU, gloo"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import offline_runs
from results_file import record, write
from server_process import free_port


def weight_specs(model: Any) -> list[tuple[str, str, list[int]]]:
    """(checkpoint name, dtype, shape) of every parameter of a Llama (one rank), the fused
    q|k|v and gate|up as their projections (as rl_gpu.checkpoint_named, without copies)."""
    out = []
    for name, p in model.named_parameters():
        dtype = str(p.dtype)
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            for part, rows in zip(("q_proj", "k_proj", "v_proj"),
                                  (attn.q_size, attn.kv_size, attn.kv_size)):
                out.append((name.replace("qkv_proj", part), dtype, [rows, *p.shape[1:]]))
        elif ".gate_up_proj." in name:
            for part in ("gate_proj", "up_proj"):
                out.append((name.replace("gate_up_proj", part), dtype,
                            [p.shape[0] // 2, *p.shape[1:]]))
        else:
            out.append((name, dtype, list(p.shape)))
    return out


def trainer(port: int, specs: list[tuple[str, str, list[int]]], device: str, conn: Any) -> None:
    """Rank 0: random weights of the specs on `device` (seeded), their float64 sum sent to the
    parent first, then each broadcast in order."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    g = torch.Generator(device=device).manual_seed(0)
    tensors = [(torch.randn(shape, generator=g, device=device) * 0.02).to(
        getattr(torch, dtype.removeprefix("torch."))) for _, dtype, shape in specs]
    conn.send(sum(float(t.double().sum()) for t in tensors))
    # (the store's master waits for the engine to connect: made after the sum is sent)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=600))
    group = (dist.ProcessGroupNCCL(store, 0, 2) if device.startswith("cuda")
             else dist.ProcessGroupGloo(store, 0, 2))
    for t in tensors:
        group.broadcast(t, 0).wait()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    conn.send("done")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=offline_runs.LLAMA_8B)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny random Llama")
    args = ap.parse_args()
    import torch

    if not args.smoke and torch.cuda.device_count() < 2:
        print("rl_group_update.py needs two GPUs (the engine on cuda:0, the trainer on "
              "cuda:1: NCCL refuses two ranks on one device); --smoke runs gloo on the CPU",
              file=sys.stderr)
        return 2
    from shoal import LLM, SamplingParams

    model = args.model if not args.smoke else offline_runs.tiny_llama(Path(tempfile.mkdtemp()))
    kw: dict[str, Any] = (dict(load_format="dummy", max_model_len=4096, device="cuda:0",
                               gpu_memory_utilization=0.6) if not args.smoke else
                          dict(load_format="dummy", device="cpu", max_model_len=512))
    llm = LLM(model, **kw)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 164))}
    before = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    specs = weight_specs(llm.llm_engine.core.runner.model)
    nbytes = sum(torch.Size(s).numel() * getattr(torch, d.removeprefix("torch.")).itemsize
                 for _, d, s in specs)
    port = free_port()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=trainer, args=(port, specs, "cpu" if args.smoke else "cuda:1", child))
    proc.start()
    try:
        sent_sum = parent.recv()  # (the trainer's weights are made: the clock starts below)
        llm.init_weight_update_group("127.0.0.1", port, 1, 2)
        t0 = time.perf_counter()
        llm.update_weights_from_group([n for n, _, _ in specs], [d for _, d, _ in specs],
                                      [s for _, _, s in specs])
        if not args.smoke:
            torch.cuda.synchronize("cuda:0")
        seconds = time.perf_counter() - t0
        assert parent.recv() == "done"
    finally:
        proc.join(timeout=120)
    got_sum = sum(llm.collective_rpc("weights_checksum"))
    after = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    rec = record("rl_group_update", "shoal", model=args.model, smoke=args.smoke,
                 backend="gloo" if args.smoke else "nccl",
                 devices="cpu" if args.smoke else "engine cuda:0, trainer cuda:1",
                 tensors=len(specs), update_bytes=nbytes, update_s=seconds,
                 update_gb_s=nbytes / seconds / 1e9, trainer_sum=sent_sum, engine_sum=got_sum,
                 weights_match=abs(got_sum - sent_sum) <= 1e-6 * max(1.0, abs(sent_sum)),
                 tokens_changed=after != before)
    print(rec)
    write([rec], args.out)
    return 0 if rec["weights_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
