"""Two dense projections of the same input run as one GEMM, their parameters kept as they are.

MLA projects each token's hidden state twice: the queries (q_proj, or q_a_proj with a query
latent) and the compressed KV with the shared rotary key (kv_a_proj_with_mqa). At batch 1 on
the H100 each cuBLAS GEMV of V2-Lite's takes about 7.6 us whatever its size (0.8-4 us of
reads): one launch of both reads the same bytes in about one launch's time.

The two layers keep their parameters and names (checkpoints, weight updates, LoRA targets,
sleep and wake are unchanged), but their weights are made views of one [N1 + N2, K] storage
at construction, so everything that writes them in place (the loaders' copy_, dummy weights,
weight updates) writes the joined matrix. Whatever replaces a weight instead (FP8/INT4 packed
weights, weight offloading, CPU int4, LoRA deltas, a bias) makes `joined_weight` None and the
layers run apart, as before."""

from __future__ import annotations

import torch
from torch import nn

from shoal.layers.ops import dense_linear


def _weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight  # type: ignore[return-value]


class SharedInputLinear:
    """first and second: dense linears (weight [N, K], same K, dtype and device) with no bias,
    right after construction."""

    def __init__(self, first: nn.Module, second: nn.Module):
        w1, w2 = _weight(first), _weight(second)
        if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != w2.shape[1]:
            raise ValueError(f"the two projections must share their input size: "
                             f"{tuple(w1.shape)} and {tuple(w2.shape)}")
        if w1.dtype != w2.dtype or w1.device != w2.device:
            raise ValueError("the two projections must share dtype and device")
        self.first, self.second = first, second
        self.sizes = (w1.shape[0], w2.shape[0])
        joined = torch.empty(sum(self.sizes), w1.shape[1], dtype=w1.dtype, device=w1.device)
        if w1.device.type != "meta":
            joined[:self.sizes[0]].copy_(w1)
            joined[self.sizes[0]:].copy_(w2)
        w1.data = joined[:self.sizes[0]]
        w2.data = joined[self.sizes[0]:]
        # (no reference to `joined` is kept: a layer whose weight moves elsewhere, weight
        # offloading's host copy, must free it; the joined view is rebuilt from the halves)
        self._view: tuple[tuple[int, int], torch.Tensor] | None = None
        self._joined_at = joined.untyped_storage().data_ptr()  # (an address, not a reference)

    def joined_weight(self) -> torch.Tensor | None:
        """The [N1 + N2, K] matrix while the two weights are still adjacent halves of one
        storage and nothing else transforms either layer's output; else None."""
        for layer in (self.first, self.second):
            if (getattr(layer, "bias", None) is not None or getattr(layer, "quant", None)
                    is not None or getattr(layer, "int4", None) is not None
                    or getattr(layer, "lora", None) is not None):
                return None
        w1, w2 = _weight(self.first), _weight(self.second)
        k = w1.shape[1] if w1.dim() == 2 else -1
        key = (w1.data_ptr(), w2.data_ptr())
        if self._view is not None and self._view[0] == key:
            return self._view[1]
        self._view = None
        if (w1.shape != (self.sizes[0], k) or w2.shape != (self.sizes[1], k)
                or not w1.is_contiguous() or not w2.is_contiguous()
                or w2.data_ptr() != w1.data_ptr() + w1.numel() * w1.element_size()
                or w1.untyped_storage().data_ptr() != w2.untyped_storage().data_ptr()):
            return None
        joined = w1.as_strided((sum(self.sizes), k), (k, 1))
        self._view = (key, joined)
        return joined

    def settle(self) -> None:
        """After loading (build_model): where the layers cannot run joined (one weight packed
        as FP8/INT4 or CPU int4, a bias), give each weight still a view of the joined storage
        its own copy, or that half would keep the whole joined matrix allocated."""
        if self.joined_weight() is not None:
            return
        self._view = None
        for layer in (self.first, self.second):
            w = _weight(layer)
            # (only a view of the joined storage: a weight offloading moved into its layer's
            # host buffer is a view of a larger storage too, and must stay one)
            if (w.numel() and w.untyped_storage().data_ptr() == self._joined_at
                    and w.untyped_storage().nbytes() > w.numel() * w.element_size()):
                w.data = w.data.clone()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first(x), second(x)): one GEMM where the weights are still joined (the outputs
        are then column slices of one [T, N1 + N2] tensor), else each layer's own forward."""
        y = self.joined_output(x)
        if y is None:
            return self.first(x), self.second(x)
        return y[..., :self.sizes[0]], y[..., self.sizes[0]:]

    def joined_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """[T, N1 + N2], first(x) then second(x), from the one GEMM; None where the layers
        run apart."""
        joined = self.joined_weight()
        if joined is None:
            return None
        # a Triton GEMV only where both layers may take one (a replicated one over several
        # ranks may not: layers/linear.py ReplicatedLinear)
        gemv = all(getattr(m, "triton_gemv", False) for m in (self.first, self.second))
        return dense_linear.linear(x, joined, None, gemv)


def settle_all(model: nn.Module) -> int:
    """SharedInputLinear.settle on every pair the model's modules hold; how many run apart."""
    apart = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, SharedInputLinear):
                value.settle()
                apart += value.joined_weight() is None
    return apart
