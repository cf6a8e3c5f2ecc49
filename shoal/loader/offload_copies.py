"""The copies of offloaded layers' weights into their staging slots (weight_offload.py), one
per layer per forward pass, issued from each layer's forward pre-hook.

Without prefetch (one staging slot: the CPU default) layer k's copy runs on the forward's own
stream just before layer k; stream order keeps layer k-1's kernels ahead of the copy that
overwrites their weights.

With prefetch (two slots, layer k in slot k % 2: on CUDA with SHOAL_OFFLOAD_PREFETCH=1) the copy of layer k+1 is
issued on a side stream when layer k starts, so it crosses the host link while layer k
computes:
- layer k's kernels wait for its copy (an event recorded after it on the side stream);
- the copy into slot (k+1) % 2 waits for what the forward's stream had queued when layer k
  started, which ends with layer k-1's kernels: the last readers of that slot.
A layer whose copy was not prefetched (the first offloaded one, or a forward that runs the
layers out of order) gets its copy issued the same way on the spot. Under CUDA graph capture
the side stream forks from the capturing stream and joins it again at each wait, so the graph
holds the copies and these dependencies as edges and its replays overlap the same way; every
prefetch is waited on by the next layer (the last offloaded layer prefetches nothing), so no
fork is left open at the end of a forward.

On the CPU a "copy" is synchronous, so prefetch gains nothing there; it still runs the same
slot schedule (tests check it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCopy:
    src: torch.Tensor  # the layer's host buffer (uint8, pinned on CUDA)
    dst: torch.Tensor  # the head of its staging slot, as many bytes


class LayerCopies:
    def __init__(self, copies: list[LayerCopy], device: torch.device, prefetch: bool):
        self.copies = copies
        self.prefetch = prefetch
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pending: int | None = None  # the layer whose copy was prefetched
        self.issued = 0  # copies issued so far (tests)
        if self._cuda and prefetch:
            self.stream = torch.cuda.Stream(self.device)
            self._copied = [torch.cuda.Event() for _ in copies]  # each layer's copy done
            self._queued = torch.cuda.Event()  # the forward's stream at a layer's start

    def before_layer(self, k: int) -> None:
        """Layer k's weights in its slot before its kernels run (what the caller then
        queues waits for them), and with prefetch layer k+1's copy under way."""
        if not self.prefetch:
            self.copies[k].dst.copy_(self.copies[k].src, non_blocking=True)
            self.issued += 1
            return
        if self._pending != k:
            self._issue(k)
        self._pending = None
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copied[k])
        if k + 1 < len(self.copies):
            self._issue(k + 1)
            self._pending = k + 1

    def _issue(self, k: int) -> None:
        copy = self.copies[k]
        self.issued += 1
        if not self._cuda:
            copy.dst.copy_(copy.src)
            return
        # after everything queued so far, the last reads of this slot among it
        self._queued.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self._queued)
        with torch.cuda.stream(self.stream):
            copy.dst.copy_(copy.src, non_blocking=True)
        self._copied[k].record(self.stream)
