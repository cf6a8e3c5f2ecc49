"""CUDA graphs on trial, for a model whose forward pass shoal did not write.

shoal's own classes are written for capture (one that cannot be says why: eager_only_reason,
engine/graph_support.py). The Transformers backend runs transformers' modeling code, which
may wait on the device (`.item()`, `nonzero`, a tensor's truth value) or take a Python branch
on a value that a graph would freeze. Which architectures do changes with each transformers
release, so rather than keep a list the runner finds out per model at start-up, on the
graphs it captures for serving anyway (a model class opts in with `check_graph_capture`):

1. the capture itself: a host sync inside a capture raises;
2. one replay against the eager forward: a decode step of made-up requests (token ids,
   positions and context lengths unlike the capture's zeros) replayed from its graph must
   give the eager step's logits; a graph that froze something of the step it was captured
   on gives others.

A model that fails either runs eagerly, as under enforce_eager, said in one log line with the
reason. The check costs one short prefill, one decode and one replay; no extra capture. All
ranks take one verdict: the check's eager passes and every later step run collectives that
the ranks must issue alike."""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shoal.attention.metadata import token_slots
from shoal.core.kv_cache_spec import KVCacheGroup
from shoal.distributed.parallel_state import world_min_int
from shoal.host_to_device import to_device
from shoal.worker.graph_table import StepShape
from shoal.worker.model_graphs import ModelGraphs
from shoal.worker.step_forward import StepForwarder
from shoal.worker.warmup import dummy_blocks

logger = logging.getLogger(__name__)

# Largest difference allowed between a replayed step's logits and the eager step's, as a
# fraction of the eager logits' largest magnitude. Kernels picked for a graph's fixed shapes
# may round differently from the eager ones (16-bit: a few units of the last place through
# every layer); a graph that froze the capture step's inputs is off by the logits' own size.
TOLERANCE_FP32 = 1e-3
TOLERANCE_16BIT = 5e-2
# The check's requests: the tokens each has cached before its decode (distinct, non-zero
# positions: the capture ran at position 0 over no context).
_CONTEXT_LENS = (5, 11, 17, 23)


class CheckedRunner(Protocol):
    """What the check uses of shoal.worker.model_runner.ModelRunner."""

    config: Any  # EngineConfig (its scheduler_config.max_model_len)
    model: nn.Module
    forwarder: StepForwarder
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    block_size: int
    null_block: int
    kv_groups: tuple[KVCacheGroup, ...]


def capture_checked(graphs: ModelGraphs, runner: CheckedRunner) -> float | None:
    """Captures `graphs` and checks a replay against the eager forward: the capture's seconds,
    or None when the model must run eagerly (logged once with the reason)."""
    took = 0.0
    reason = _agreed(host_sync_reason(runner), runner.device)
    if reason is None:
        try:
            with stream_kept(runner.device):
                took = graphs.capture()
        except torch.OutOfMemoryError:
            raise  # (memory, not the forward's code: as for any model)
        except Exception as e:  # what the forward does under capture that the probe missed
            reason = f"capturing its forward raised {describe_error(e)}"
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
                end_capture_state(runner.device)
        reason = _agreed(reason, runner.device)
    if reason is None:
        try:
            reason = replay_mismatch(graphs, runner)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # (graphs are optional: without a verdict, none)
            reason = f"checking a replay raised {describe_error(e)}"
        reason = _agreed(reason, runner.device)
    name = model_name(runner.model)
    if reason is not None:
        logger.warning("%s runs without CUDA graphs (eagerly, as with enforce_eager): %s",
                       name, reason)
        return None
    logger.info("%s: CUDA graphs checked (a replayed decode step gives the eager step's "
                "logits)", name)
    return took


def host_sync_reason(runner: CheckedRunner) -> str | None:
    """On CUDA, why an eager decode step of the model cannot be captured, found without a
    capture: the step runs under torch's sync debug mode "error", which raises on a host sync
    (.item(), nonzero, a copy from pageable memory) as a capture would. A capture that fails
    leaves torch's CUDA generator in capture state (its capture_end raises before the
    generator's epilogue), and every later random draw of the process then fails."""
    if runner.device.type != "cuda":
        return None
    first, count = dummy_blocks(runner)
    rows = min(2, count)
    tables = [[first + i] for i in range(rows)]
    md = runner.forwarder.metadata([1] * rows, [1] * rows, [tables] * len(runner.kv_groups),
                                   rows)
    ids = torch.ones(rows, dtype=torch.long, device=runner.device)
    pos = torch.ones(rows, dtype=torch.long, device=runner.device)
    torch.cuda.synchronize(runner.device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            runner.model(ids, pos, md)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        return f"an eager decode step synchronizes with the host: {describe_error(e)}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def end_capture_state(device: torch.device) -> None:
    """After a capture that failed: one trivial capture, whose end runs the CUDA generator's
    epilogue the failed one skipped (see host_sync_reason)."""
    try:
        graph, x = torch.cuda.CUDAGraph(), torch.zeros(1, device=device)
        with torch.cuda.graph(graph):
            x.add_(1)
    except Exception:  # (best effort: the warning names the first failure already)
        logger.debug("resetting the capture state after a failed capture failed",
                     exc_info=True)


def replay_mismatch(graphs: ModelGraphs, runner: CheckedRunner) -> str | None:
    """Why a decode step replayed from its captured graph is not the eager step, or None.
    Writes the check's requests into blocks of the pool: call it before any request runs."""
    with torch.inference_mode():
        return _replay_mismatch(graphs, runner)


def _replay_mismatch(graphs: ModelGraphs, runner: CheckedRunner) -> str | None:
    if not graphs.decode_sizes:
        return "no decode step was captured"
    # two requests or more where a graph holds them (one row would not show rows mixed up)
    rows = next((s for s in graphs.decode_sizes if s >= 2), graphs.decode_sizes[-1])
    longest = runner.config.scheduler_config.max_model_len - 1  # (and the decoded token)
    contexts = [max(1, min(longest, _CONTEXT_LENS[i % len(_CONTEXT_LENS)]
                           + 32 * (i // len(_CONTEXT_LENS)))) for i in range(rows)]
    bs = runner.block_size
    first, count = dummy_blocks(runner)
    tables: list[list[int]] = []
    for c in contexts:  # each request's blocks hold its context and the decoded token
        n = -(-(c + 1) // bs)
        start = first + sum(len(t) for t in tables)
        tables.append(list(range(start, start + n)))
    needed = sum(len(t) for t in tables)
    if needed > count:
        return f"the KV pool's {count} blocks are too few for the check's {needed}"
    groups = [tables] * len(runner.kv_groups)  # (every group: the same block ids)
    gen = torch.Generator().manual_seed(0)
    vocab, device, model = runner.vocab_size, runner.device, runner.model
    # The requests' cached tokens, eagerly: the eager decode and the replay both read them.
    prompt = torch.randint(1, vocab, (sum(contexts),), generator=gen)
    pos = torch.cat([torch.arange(c) for c in contexts])
    md = runner.forwarder.metadata(contexts, [0] * rows, groups, 0)
    model(prompt.to(device), pos.to(device), md)
    ids = torch.randint(1, vocab, (rows,), generator=gen).tolist()
    md = runner.forwarder.metadata([1] * rows, contexts, groups, rows)
    hidden = model(to_device(ids, torch.long, device), to_device(contexts, torch.long, device),
                   md)
    eager = model.compute_logits(hidden)
    # The replay writes the same keys and values into the same slots.
    shape = StepShape(rows, 1)
    slots = token_slots([1] * rows, contexts, tables, bs)
    graphs.table.stage(shape, (ids, contexts, []), contexts, groups,
                       [slots] * len(runner.kv_groups))
    replayed = graphs.table.replay(shape)[0][:rows]
    graphs.invalidate_tables()
    return logits_mismatch(eager, replayed, runner.dtype)


def logits_mismatch(eager: torch.Tensor, replayed: torch.Tensor,
                    dtype: torch.dtype) -> str | None:
    """Why `replayed` is not `eager` (the same step's logits, [rows, vocab]), or None."""
    if eager.shape != replayed.shape:
        return (f"a replayed decode step gave logits of shape {tuple(replayed.shape)}, the "
                f"eager step {tuple(eager.shape)}")
    e, r = eager.float(), replayed.float()
    if not bool(torch.isfinite(e).all()):
        return "the eager decode step's logits are not finite (the replay cannot be checked)"
    if not bool(torch.isfinite(r).all()):
        return "a replayed decode step gave non-finite logits where the eager step's are finite"
    scale = float(e.abs().max()) or 1.0
    diff = float((r - e).abs().max()) / scale
    tol = TOLERANCE_FP32 if dtype == torch.float32 else TOLERANCE_16BIT
    if diff > tol:
        return (f"a replayed decode step's logits differ from the eager step's by {diff:.3g} "
                f"of their largest magnitude (tolerance {tol:g}): the graph kept values of "
                "the step it was captured on")
    return None


def describe_error(exc: BaseException) -> str:
    """The error a capture ran into and where, in one line. A capture that fails raises
    again when it ends ("operation failed due to a previous error during capture"): the
    first error is the one the forward ran into."""
    while exc.__context__ is not None and _ends_a_failed_capture(exc):
        exc = exc.__context__
    text = " ".join(str(exc).split())
    text = text.split(" CUDA kernel errors might be", 1)[0]  # (torch's advice, not the cause)
    where = _raised_at(exc)
    return f"{type(exc).__name__}: {text}" + (f" (at {where})" if where else "")


def _ends_a_failed_capture(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    in_graph_exit = bool(frames) and frames[-1].filename.endswith(
        str(Path("torch", "cuda", "graphs.py")))
    return in_graph_exit or "previous error during capture" in str(exc)


def _raised_at(exc: BaseException) -> str | None:
    """The innermost frame outside torch (the model code's line), as folder/file:line."""
    torch_dir = str(Path(torch.__file__).parent)
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        if not f.filename.startswith(torch_dir):
            p = Path(f.filename)
            return f"{p.parent.name}/{p.name}:{f.lineno} in {f.name}"
    return None


def model_name(model: nn.Module) -> str:
    """The architecture a wrapping class runs (the Transformers backend's `architecture`)."""
    arch = getattr(model, "architecture", None)
    cls = type(model).__name__
    return f"{arch} ({cls})" if isinstance(arch, str) and arch != cls else cls


def _agreed(reason: str | None, device: torch.device) -> str | None:
    """This rank's reason, or one naming another rank when only that one failed."""
    if world_min_int(int(reason is None), device) or reason is not None:
        return reason
    return "another rank's check failed (its log says why)"


@contextlib.contextmanager
def stream_kept(device: torch.device) -> Iterator[None]:
    """The current stream is the same after: a capture that fails leaves torch's capture
    stream current (torch.cuda.graph's exit raises before it restores the stream)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.current_stream(device)):
        yield
