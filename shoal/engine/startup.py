"""The engine's start-up sequence, written once for the server's engine process
(core_proc._build_core) and the offline LLM (llm_engine.LLMEngine): check the request limits,
seed, give the model its CPU threads, load the model, apply the config overrides, build the
engine config and the EngineCore.

What differs between the two is one parameter, `serving`:
- the server's engine leaves a core to the frontend process (cpu_threads.py) and takes
  short CPU steps, so first tokens come soon (cpu_defaults.py);
- the offline engine uses every core it can (at most torch's count) and takes large steps.
Both adapt their CPU threads to what other processes leave them (cpu_governor.py)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.engine.core import EngineCore
from shoal.engine.cpu_governor import thread_governor
from shoal.engine.cpu_threads import configure_cpu_threads
from shoal.engine.engine_args import EngineArgs
from shoal.engine.generation_defaults import GenerationDefaults, read_generation_defaults
from shoal.engine.kv_connector_setup import attach_kv_connector
from shoal.engine.kv_events import attach_kv_events
from shoal.engine.request_checks import RequestLimits
from shoal.engine.startup_heap import collect_stopped_engines
from shoal.loader import load_model

logger = logging.getLogger(__name__)


@dataclass
class StartedEngine:
    """What start-up built: the core (its config: core.config) and the model's tokenizer
    (None when the model has none)."""

    core: EngineCore
    tokenizer: Any


def start_engine_core(args: EngineArgs, *, serving: bool) -> StartedEngine:
    """Builds the EngineCore for `args`; `serving`: for the server's engine process (see the
    module's docstring)."""
    t0 = time.perf_counter()
    limits = RequestLimits.from_engine_args(args)  # checked before the model loads
    kv_events = args.kv_events_settings()  # likewise (engine/kv_events_args.py)
    kv_transfer = args.kv_transfer_settings()  # and the KV connector's (kv_transfer_args.py)
    torch.manual_seed(args.seed)
    device = args.resolved_device()
    # The CUDA context starts (a second or so of driver work) while the config and the
    # tokenizer load on this thread; the model's first tensor waits for it, if need be.
    cuda_init = None
    if device.type == "cuda":
        cuda_init = threading.Thread(target=_start_cuda, args=(device,), daemon=True)
        cuda_init.start()
    # Before the engine config: on the CPU a serving step's token budget follows the threads.
    threads = configure_cpu_threads(device.type, args.cpu_threads, serving=serving)
    if threads is not None:
        logger.info("model threads on the CPU: %d", threads)
    loaded = load_model(args.model, tokenizer=args.tokenizer, load_format=args.load_format,
                        quantization=args.quantization,
                        language_model_only=args.language_model_only())
    args.apply_hf_overrides(loaded.hf_config)
    config = args.create_engine_config(loaded.hf_config, loaded.source, serving=serving)
    if cuda_init is not None:
        cuda_init.join()
    # (engines stopped before this one give their device memory back before it is measured)
    collect_stopped_engines(device)
    t1 = time.perf_counter()
    core = EngineCore(config, loaded, request_limits=limits,
                      generation=generation_defaults(args, config, loaded))
    core.thread_governor = thread_governor(device.type, threads, args.cpu_threads)
    attach_kv_events(core, kv_events)
    try:
        attach_kv_connector(core, kv_transfer, loaded.source)
    except BaseException:
        core.shutdown()
        raise
    core.startup_times["load_config"] = t1 - t0
    core.startup_times["engine_core"] = time.perf_counter() - t1
    return StartedEngine(core, loaded.tokenizer)


def generation_defaults(args: EngineArgs, config: Any, loaded: Any) -> GenerationDefaults:
    """What a generating model's requests inherit from its generation_config.json
    (--generation-config; none for a pooling model)."""
    if config.model_config.runner != "generate":
        return GenerationDefaults()
    folder = Path(loaded.source)
    return read_generation_defaults(args.generation_config, folder if folder.is_dir() else None,
                                    args.override_generation_config, loaded.eos_token_ids())


def _start_cuda(device: torch.device) -> None:
    torch.cuda.init()
    torch.empty(1, device=device)
