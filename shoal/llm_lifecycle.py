"""The offline LLM's side of engines inside training loops (vLLM's RL lifecycle): sleep and
wake, weight updates from tensors, a folder or the trainer's process group, prefix-cache
resets and lifecycle methods on every rank, generation paused and resumed. Each needs an idle
engine (between generate calls, or paused); the engine core checks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class LifecycleMixin:
    llm_engine: Any

    @property
    def _core(self) -> Any:
        return self.llm_engine.core

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Level 1: the weights to host memory, the KV cache freed; level 2: both freed (the
        weights come back by an update). Returns the bytes freed and the time taken."""
        return self._core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """tags: "weights" and/or "kv_cache" (default both)."""
        self._core.wake_up(list(tags) if tags is not None else None)

    def is_sleeping(self) -> bool:
        return bool(self._core.sleep_level)

    def pause_generation(self, wait_for_inflight_requests: bool = False,
                         clear_cache: bool = True) -> None:
        """vLLM's (engine/pause.py). Offline nothing runs between calls unless requests were
        added to llm_engine directly: they are aborted, or stepped to their end with
        wait_for_inflight_requests. A generate call while paused raises a ValueError, since
        nothing could resume it; update_weights and sleep may run."""
        core = self._core
        core.pause.offline = True
        core.pause_generation(wait_for_inflight_requests, clear_cache)
        while not core.pause.settled(core):
            self.llm_engine.step()

    def resume_generation(self) -> None:
        self._core.resume_generation()

    def is_paused(self) -> bool:
        return bool(self._core.pause.paused)

    def reset_prefix_cache(self) -> bool:
        return self._core.reset_prefix_cache()

    def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """A lifecycle method (shoal/worker/lifecycle.py RPC_METHODS) on every rank."""
        return self._core.collective_rpc(method, list(args))

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
        """Checkpoint-named, unsharded tensors into the running model (any subset); the
        prefix cache is emptied. Returns how many tensors were loaded."""
        return self._core.update_weights(weights)

    def update_weights_from_path(self, path: str) -> int:
        """A checkpoint folder (or .gguf) of this model's architecture."""
        return self.collective_rpc("update_weights_from_path", [str(path)])[0]

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 backend: str | None = None) -> None:
        """Every rank joins the trainer's group (the trainer is rank 0; this engine's ranks are
        rank_offset, rank_offset + 1, ...): NCCL on CUDA, gloo on the CPU."""
        self.collective_rpc("init_weight_update_group",
                            [master_address, master_port, rank_offset, world_size, backend])

    def update_weights_from_group(self, names: Sequence[str], dtypes: Sequence[Any],
                                  shapes: Sequence[Sequence[int]]) -> int:
        """Receives the named tensors from the group's rank 0 (which broadcasts them in this
        order) and loads them."""
        return self.collective_rpc("update_weights_from_group", [
            list(names), [str(d).removeprefix("torch.") for d in dtypes],
            [list(s) for s in shapes]])[0]
