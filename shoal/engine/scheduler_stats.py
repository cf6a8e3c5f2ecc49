"""The parts of the scheduler's statistics that only some engines have: LoRA adapters,
images' encoder cache, linear-attention states."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.core.request import Request
from shoal.core.types import SchedulerStats
from shoal.engine.encoder_schedule import EncoderSchedule
from shoal.kv_cache.manager import KVCacheManager


def add_feature_stats(s: SchedulerStats, max_loras: int, running: Sequence[Request],
                      waiting: Sequence[Request], kv: KVCacheManager,
                      encoders: EncoderSchedule | None) -> None:
    if max_loras:
        s.max_loras = max_loras
        s.running_loras = sorted({r.lora.lora_name for r in running if r.lora})
        s.waiting_loras = sorted({r.lora.lora_name for r in waiting if r.lora})
    if encoders is not None:
        s.mm_items_encoded = encoders.num_encoded
        s.mm_cache_hits = encoders.num_hits
    if kv.state_bytes_per_request:
        s.num_state_blocks = kv.num_state_blocks()
        s.state_bytes_per_request = kv.state_bytes_per_request
