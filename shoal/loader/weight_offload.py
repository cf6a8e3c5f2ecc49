"""Weight offloading (vLLM's `cpu_offload_gb`): whole decoder layers, from the first, keep
their parameters in host memory (pinned on CUDA) up to a byte budget per rank, and each
forward pass copies an offloaded layer's weights into a device staging slot before the
layer runs.

Why staging, not vLLM's zero-copy reads of host memory (UVA): the copy is one plain
host-to-device memcpy per layer, so a CUDA graph captures it as a memcpy node and replays it
(a layer's host buffer never moves; weight updates write into it in place), and the layer's
kernels then read device memory at full speed instead of pulling every weight over PCIe at
the access pattern of a GEMM. The staging buffer holds one slot, or two with prefetch (on
CUDA with SHOAL_OFFLOAD_PREFETCH=1 until its GPU test has passed on a GPU, or
`WeightOffloader.default_prefetch`): layer k+1's copy then runs on a side
stream while layer k computes, layer k in slot k % 2 (offload_copies.py has the ordering).
Each slot is the size of the largest offloaded layer, so what offloading saves is the
offloaded bytes less the staging buffer. At batch 1 a layer's copy takes tens of times its
compute, so prefetch hides little there; steps of many tokens (W1) hide more of it.

The stages (shoal/loader/build.py drives them):
- construction, inside `building()`: a module-registration hook sees each decoder layer as it
  is added to its nn.ModuleList (built on the device); while the budget lasts, the layer's
  parameters move into one host buffer of its own, so an offloaded layer is on the device
  only between its construction and its registration (where a model builds its layers into
  a ModuleList one by one, as Llama's does, the build never holds them all);
- loading: the parameters point at their host copies, so the weights load there;
- `activate(model)`: the staging buffer is allocated, every offloaded parameter points into
  its layer's slot, and a forward pre-hook per layer has the layer's host buffer copied in;
- `at_home()`: the parameters point at their host copies again while a weight update (or a
  checksum) runs, then back at the staging buffer.

Sleep (worker/sleep_mode.py) frees and restores the staging buffer like a parameter
storage but copies nothing out of it (`scratch_storages`: its content does not matter, each
forward copies in), while the host copies stay where they are at both levels, so a level-2
sleep keeps the offloaded layers' weights. rank_info reports each rank's offloaded layers
and bytes.

The mechanism is device-generic: on the CPU the "host copy" and the staging buffer are both
host tensors (tests run it there; the engine argument itself does nothing on a CPU engine)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from shoal import envs
from shoal.layers.attention import Attention
from shoal.layers.compressed_attention import CompressedAttention
from shoal.layers.latent_attention import LatentAttention
from shoal.layers.linear_attention import LinearAttention
from shoal.loader.offload_copies import LayerCopies, LayerCopy

logger = logging.getLogger(__name__)

# Where each parameter starts in its layer's buffer: a multiple of this, so every dtype view
# is aligned as the kernels (cuBLAS, Triton) want it.
ALIGN = 256
# What makes a module a decoder layer: it holds one of the paged attention layers.
_ATTENTION_TYPES = (Attention, LatentAttention, LinearAttention, CompressedAttention)
# The model attribute the offloader hangs on (worker/lifecycle.py finds it there).
ATTRIBUTE = "weight_offloader"


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layer_layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Each parameter's byte offset in its layer's buffer, and the buffer's size."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += aligned(p.numel() * p.element_size())
    return offsets, total


class OffloadBudget:
    """Whole layers, in order, while they fit: the first layer that does not fit ends the
    offloading, so the offloaded layers are always the first ones and never exceed `budget`
    bytes together (a smaller layer further on is not taken)."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"an offload budget must be >= 0 bytes (got {budget})")
        self.budget, self.used, self.closed = budget, 0, budget == 0

    def take(self, nbytes: int) -> bool:
        if self.closed or self.used + nbytes > self.budget:
            self.closed = True
            return False
        self.used += nbytes
        return True


def is_decoder_layer(module: nn.Module) -> bool:
    return any(isinstance(m, _ATTENTION_TYPES) for m in module.modules())


@dataclass(frozen=True)
class OffloadStats:
    """What start-up reports: which layers live in host memory and what that saves."""

    layers: tuple[str, ...]  # their module names, in order
    offloaded_bytes: int  # their host buffers (the budget's count)
    staging_bytes: int  # the device buffer they are copied into (one or two slots)
    budget_bytes: int

    @property
    def device_bytes_saved(self) -> int:
        return max(self.offloaded_bytes - self.staging_bytes, 0)


@dataclass
class _OffloadedLayer:
    module: nn.Module
    params: list[nn.Parameter]
    offsets: list[int]  # each parameter's byte offset, in its host and staging buffers
    home: torch.Tensor  # uint8 host buffer (pinned on CUDA)
    home_views: list[torch.Tensor]  # each parameter's view of it
    staging_views: list[torch.Tensor] = field(default_factory=list)
    staging_used: torch.Tensor | None = None  # the head of the staging slot it fills


class WeightOffloader:
    # Prefetch (layer k+1 copied on a side stream while layer k computes, two staging slots)
    # when the constructor is not told: None means SHOAL_OFFLOAD_PREFETCH on CUDA (off by
    # default: its GPU test has not passed on a GPU yet; on the CPU a copy is synchronous
    # anyway). The GPU test and benchmarks/rl_gpu.py set it to compare.
    default_prefetch: bool | None = None

    def __init__(self, budget_bytes: int, device: torch.device, prefetch: bool | None = None):
        self.budget = OffloadBudget(budget_bytes)
        self.device = torch.device(device)
        if prefetch is None:
            prefetch = self.default_prefetch
        if prefetch is None:
            prefetch = self.device.type == "cuda" and envs.SHOAL_OFFLOAD_PREFETCH.get()
        self.prefetch = bool(prefetch)
        self.layers: list[_OffloadedLayer] = []
        self.staging: torch.Tensor | None = None  # every slot, one after the other
        self.copies: LayerCopies | None = None
        self.stats: OffloadStats | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._moved: set[int] = set()  # ids of the parameters in host buffers
        self._seen = 0  # decoder layers the constructor registered

    # ---- construction -----------------------------------------------------------------------
    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Offloads each decoder layer, within the budget, as the model's constructor
        registers it."""
        handle = register_module_module_registration_hook(self._on_register)
        try:
            yield
        finally:
            handle.remove()

    def _on_register(self, parent: nn.Module, name: str, module: nn.Module | None) -> None:
        if (module is None or not isinstance(parent, nn.ModuleList) or self.budget.closed
                or not is_decoder_layer(module)):
            return
        params = [p for p in module.parameters() if p.numel()]
        if not params or any(id(p) in self._moved for p in params):
            return  # nothing to move, or a part of it offloaded already (a nested list)
        self._seen += 1
        offsets, total = layer_layout(params)
        if not self.budget.take(total):
            return
        home = torch.empty(total, dtype=torch.uint8, device="cpu",
                           pin_memory=self.device.type == "cuda")
        views = []
        for p, off in zip(params, offsets):
            view = _view(home, off, p)
            view.copy_(p.data)
            p.data = view  # the device copy is freed here
            views.append(view)
            self._moved.add(id(p))
        self.layers.append(_OffloadedLayer(module, params, offsets, home, views))

    # ---- serving ----------------------------------------------------------------------------
    def activate(self, model: nn.Module) -> OffloadStats:
        """After the weights are loaded: the staging buffer, the parameters pointing into
        it, one copy-in hook per layer; the model keeps the offloader (host_weights).
        Returns (and logs) what was offloaded."""
        names = {id(m): n for n, m in model.named_modules()}
        # A layer the constructor built and then dropped is not served: forget it.
        self.layers = [layer for layer in self.layers if id(layer.module) in names]
        for layer in self.layers:
            now = [p for p in layer.module.parameters() if p.numel()]
            if len(now) != len(layer.params) or any(a is not b for a, b in
                                                    zip(now, layer.params)):
                raise ValueError(f"cpu_offload_gb: {names[id(layer.module)]} replaced its "
                                 "parameters after construction (a load-time conversion); "
                                 "this model cannot offload its weights")
        self._check_not_shared(model)
        # (home sizes are multiples of ALIGN, so every slot starts aligned)
        slot = max((layer.home.numel() for layer in self.layers), default=0)
        slots = 2 if self.prefetch and len(self.layers) > 1 else 1
        self.staging = (torch.empty(slots * slot, dtype=torch.uint8, device=self.device)
                        if self.layers else None)
        copies = []
        for k, layer in enumerate(self.layers):
            assert self.staging is not None
            head = (k % slots) * slot  # layer k's slot
            layer.staging_views = [_view(self.staging, head + off, p)
                                   for off, p in zip(layer.offsets, layer.params)]
            layer.staging_used = self.staging[head:head + layer.home.numel()]
            copies.append(LayerCopy(layer.home, layer.staging_used))
            self._point(layer, home=False)
            self._hooks.append(layer.module.register_forward_pre_hook(self._copy_in(k)))
        self.copies = LayerCopies(copies, self.device, prefetch=slots == 2)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the device copies freed during the build
        self.stats = OffloadStats(tuple(names[id(layer.module)] for layer in self.layers),
                                  sum(layer.home.numel() for layer in self.layers),
                                  slots * slot, self.budget.budget)
        _report(self.stats, self.device, self._seen, slots)
        setattr(model, ATTRIBUTE, self)  # where host_weights() finds it
        return self.stats

    @contextlib.contextmanager
    def at_home(self) -> Iterator[None]:
        """The offloaded parameters point at their host copies (what a weight update must
        write, what a checksum must read), and back at the staging buffer after."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued copy still reads a host buffer
        for layer in self.layers:
            self._point(layer, home=True)
        try:
            yield
        finally:
            for layer in self.layers:
                self._point(layer, home=False)

    def scratch_storages(self) -> list[torch.Tensor]:
        """Tensors whose storage a sleep may free without keeping its bytes: the staging
        buffer (each forward copies the layers in again)."""
        return [self.staging] if self.staging is not None else []

    def _copy_in(self, k: int):  # noqa: ANN202 (a forward pre-hook)
        def hook(module: nn.Module, args: tuple) -> None:
            assert self.copies is not None
            self.copies.before_layer(k)
        return hook

    def _point(self, layer: _OffloadedLayer, home: bool) -> None:
        views = layer.home_views if home or not layer.staging_views else layer.staging_views
        for p, view in zip(layer.params, views):
            p.data = view

    def _check_not_shared(self, model: nn.Module) -> None:
        """An offloaded parameter read outside its layer (tied to another module) would see
        whatever layer the staging buffer holds: refused."""
        owner = {id(p): layer.module for layer in self.layers for p in layer.params}
        for name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                layer = owner.get(id(p))
                if layer is not None and not _within(module, layer):
                    raise ValueError(f"cpu_offload_gb: parameter {name}.{pname} is shared "
                                     "with a module outside its decoder layer; this model "
                                     "cannot offload it")


def _within(module: nn.Module, layer: nn.Module) -> bool:
    return any(m is module for m in layer.modules())


def _view(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    nbytes = p.numel() * p.element_size()
    return buffer[offset:offset + nbytes].view(p.dtype).view(p.shape)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _report(stats: OffloadStats, device: torch.device, seen: int, slots: int) -> None:
    if not stats.layers:
        logger.warning("cpu_offload_gb: nothing offloaded (%s)", "this model has no decoder "
                       "layers it can offload" if not seen else f"{_size(stats.budget_bytes)} "
                       "is less than the first decoder layer's weights")
        return
    logger.info("weight offload: %d decoder layers (%s .. %s), %s of weights in %s host "
                "memory (budget %s), copied per forward into a %s %s staging buffer (%s): "
                "%s of device memory freed for the KV cache", len(stats.layers),
                stats.layers[0], stats.layers[-1], _size(stats.offloaded_bytes),
                "pinned" if device.type == "cuda" else "plain", _size(stats.budget_bytes),
                _size(stats.staging_bytes), device.type,
                "two slots, the next layer prefetched" if slots == 2 else "one slot",
                _size(stats.device_bytes_saved))


def offloader_of(model: nn.Module) -> WeightOffloader | None:
    return getattr(model, ATTRIBUTE, None)


def host_weights(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Every parameter at the copy that holds its weights (a no-op without offloading)."""
    offloader = offloader_of(model)
    return offloader.at_home() if offloader is not None else contextlib.nullcontext()
