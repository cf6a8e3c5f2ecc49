"""The engine core's LoRA calls (vLLM's add_lora, remove_lora, pin_lora, list_loras), mixed
into EngineCore. The executor runs them on every rank; this side keeps the scheduler's rule
that a step never mixes more adapters than device slots: pinned adapters keep their slots,
the other adapters' requests share the slots left (engine/admission.py). One slot at least
stays unpinned, so that a request of any adapter runs once the requests ahead of it end:
with max_loras=1 nothing can be pinned. (vLLM lets every slot be pinned; a step that needs
another adapter then finds no free slot and fails.)

Every adapter that reaches the scheduler or the ranks from here carries the digest of its
files as they were when it arrived (versioned_lora): the prefix cache keys its blocks by it,
so re-registering an id and folder whose files were saved again never serves KV computed
with the old weights."""

from __future__ import annotations

from typing import Any

from shoal.core.executor import Executor
from shoal.lora.adapter import with_content_digest
from shoal.lora_request import LoRARequest


class CoreLoRA:
    # (set by EngineCore)
    config: Any
    runner: Executor
    scheduler: Any

    def add_lora(self, lora: LoRARequest) -> bool:
        """Reads the adapter on every rank ahead of its requests (host memory, and a device
        slot if one is free). ValueError naming the adapter when it cannot be served; the
        engine serves on."""
        self._lora_config("add_lora")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest (got {type(lora).__name__})")
        try:
            lora = with_content_digest(lora)
        except ValueError as e:
            raise ValueError(f"add_lora {lora.lora_name!r} (id {lora.lora_int_id}): {e}"
                             ) from None
        busy = next((b for b in self._busy_loras() if b.lora_int_id == lora.lora_int_id
                     and b.cache_key != lora.cache_key), None)
        if busy is not None:
            what = (f"the folder {busy.lora_path!r}" if busy.lora_path != lora.lora_path else
                    "this folder's files as they were before they were saved again")
            raise ValueError(f"add_lora {lora.lora_name!r}: adapter id {lora.lora_int_id} is "
                             f"in use by requests with {what} (an id names one adapter "
                             "while its requests run)")
        return self.runner.add_lora(lora)

    def versioned_lora(self, lora: LoRARequest | None) -> LoRARequest | None:
        """A new request's adapter with the digest of its files now (ValueError when the
        folder is no longer an adapter)."""
        return None if lora is None else with_content_digest(lora)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (and its pin) on every rank, unless a request still runs or
        waits with it (its steps would read it again from disk; a remove after they end
        drops it): False then, and when it was not loaded."""
        if any(b.lora_int_id == lora_id for b in self._busy_loras()):
            return False
        removed = self.runner.remove_lora(lora_id)
        admission = getattr(self.scheduler, "admission", None)  # (none: pooling, no LoRA)
        if admission is not None:
            admission.pinned_loras.discard(lora_id)
        return removed

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps a loaded adapter in host memory and in a device slot until it is removed.
        ValueError when it is not loaded (as vLLM), when it would pin the last unpinned slot,
        or when the running requests' other adapters need more slots than would be left
        (retry once some finish)."""
        max_loras = self._lora_config("pin_lora").max_loras
        pinned: set[int] = self.scheduler.admission.pinned_loras
        if lora_id in pinned:
            return True
        if lora_id not in self.runner.list_loras():
            raise ValueError(f"pin_lora: LoRA adapter {lora_id} is not loaded (add_lora or a "
                             "request naming it loads it)")
        if len(pinned) + 1 >= max_loras:
            raise ValueError(f"pin_lora: cannot pin LoRA adapter {lora_id}: {len(pinned)} of "
                             f"the max_loras={max_loras} device slots are pinned, and one must "
                             "stay for the other adapters' requests (raise max_loras)")
        running = {r.lora.lora_int_id for r in self.scheduler.running if r.lora is not None}
        others = sorted(running - pinned - {lora_id})
        left = max_loras - len(pinned) - 1
        if len(others) > left:
            raise ValueError(f"pin_lora: cannot pin LoRA adapter {lora_id} now: the running "
                             f"requests use adapters {others}, more than the {left} device "
                             "slot(s) that would stay unpinned; retry once some finish")
        self.runner.pin_lora(lora_id)
        pinned.add(lora_id)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (host memory or a device slot; the same on every
        rank)."""
        return self.runner.list_loras() if self.config.lora_config is not None else set()

    def _lora_config(self, what: str) -> Any:
        lora_config = self.config.lora_config
        if lora_config is None or self.runner.lora_limits is None:
            raise ValueError(f"{what}: this engine serves no LoRA adapters (start it with "
                             "enable_lora=True)")
        return lora_config

    def _busy_loras(self) -> list[LoRARequest]:
        """The adapters of the requests running or waiting."""
        s = self.scheduler
        return [r.lora for r in (*s.running, *s.waiting) if r.lora is not None]
