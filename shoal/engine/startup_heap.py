"""The engine's start-up objects kept out of the garbage collector's reach while it serves,
and handed back when it stops.

After start-up, gc.collect + gc.freeze move everything built so far (torch, the model,
tokenizer tables: millions of objects) into the collector's permanent generation. Otherwise
the first full collection comes during real traffic, as the first batch's requests add up: a
292 ms step in the middle of W8's first run on the H200, none in the second.

A frozen object is never collected, so one in a reference cycle outlives everything that
refers to it. Every linear layer's parameter is in one (its `weight_loader` attribute is the
layer's bound method), so an engine shut down and dropped kept its weights for the life of
the process (issue 37: engines created and shut down one after another inside RL loops, each
later one's KV pool smaller on the GPU). Python has one permanent generation for the whole
process, so an engine can only thaw all of it: it does at shutdown and when it is dropped,
and the next gc.collect() frees its cycles. Engines still serving in the process then freeze
the heap again at their next step (one full collection there, which also frees the dropped
engine's cycles). The price of a thaw is that next full collection, which walks the whole
heap (~0.15 s in a test process): SHOAL_FREEZE_STARTUP_HEAP=0 skips the freeze where many
small engines come and go (the test suite).

An engine on CUDA sizes its KV pool from the device's free memory, so before it does, the
engines stopped or dropped before it free their weights (collect_stopped_engines): their
cycles go and the allocator's cache gives the memory back, whether or not the caller
collected."""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch

from shoal import envs

# Engines whose start-up froze the heap and that have not shut down.
_serving: weakref.WeakSet[Any] = weakref.WeakSet()
_refreeze = False  # the heap was thawed while engines serve: their next step freezes it
_stopped = False  # an engine shut down or was dropped since the last collection for CUDA
_unfreeze_at_exit = False


def freeze_startup_heap(engine: Any) -> None:
    """At the end of `engine`'s start-up; thawed by release_startup_heap(engine) or when
    `engine` is dropped."""
    global _refreeze, _unfreeze_at_exit
    weakref.finalize(engine, _engine_stopped)  # dropped without shutdown, or shut down
    if not envs.SHOAL_FREEZE_STARTUP_HEAP.get():
        return
    gc.collect()
    if not _unfreeze_at_exit:
        # Frozen objects are never freed at exit; nanobind (triton) then reports leaks.
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.freeze()
    _refreeze = False
    _serving.add(engine)


def release_startup_heap(engine: Any) -> None:
    """At `engine`'s shutdown: what it built becomes collectable once nothing refers to it."""
    _serving.discard(engine)
    _engine_stopped()


def collect_stopped_engines(device: torch.device) -> None:
    """Before an engine on `device` is built: on CUDA, the memory of the engines stopped or
    dropped since the last such collection goes back to the device (one full collection)."""
    global _stopped
    if _stopped and device.type == "cuda":
        _stopped = False
        gc.collect()
        torch.cuda.empty_cache()


def refreeze_if_thawed() -> None:
    """At each step of a serving engine: freezes the heap again after another engine thawed
    it (one test of a flag otherwise)."""
    global _refreeze
    if _refreeze:
        _refreeze = False
        gc.collect()
        gc.freeze()


def _engine_stopped() -> None:
    global _refreeze, _stopped
    _stopped = True
    if gc.get_freeze_count():
        gc.unfreeze()
        # (iterating skips an engine being dropped now: its weak reference is already dead)
        _refreeze = any(True for _ in _serving)
