"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP tower (shoal/models/vision/
siglip.py, its patches at their plain positions 0..L-1), a projector that average-pools the
patch grid to mm_tokens_per_image tokens, norms them (Gemma's x * (1 + w)) and multiplies by
mm_input_projection_weight, and Gemma 3's text decoder (shoal/models/gemma3.py).

The soft tokens of one image attend to each other in both directions during prefill (what
transformers does when token_type_ids mark them; the <start_of_image> / <end_of_image> text
around them stays causal). ImageSpans does it: every row first gets the usual paged causal
attention, then the rows of each image span are recomputed over the keys they see through
the end of their span (context and span keys read back from the paged cache, which the layer
has just written), a sliding layer's window still applying. This assumes every image span of
a step is whole within the step (the scheduler keeps an image's span in one step for this
architecture). Either attention backend's metadata locates a span's request rows, positions
and block table: the torch one's per layer, the Triton one's from host values read once a
step, with each span's key slots (and window mask) built once per KV cache group; the
recompute itself is PyTorch either way (a span is at most a few hundred image tokens).

hf_config is transformers' Gemma3Config or the engine's flattened text config whose
`multimodal_config` is that config (shoal/loader/multimodal_config.py). Parameter names are
the checkpoint's (model.vision_tower.vision_model.*, model.multi_modal_projector.*,
model.language_model.*); lm_head is tied to the embeddings. One pipeline stage."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.attention import kv_quant
from shoal.attention.metadata import AttentionMetadata, GroupedMetadata
from shoal.layers.attention import Attention
from shoal.layers.norm import OffsetRMSNorm
from shoal.models.gemma3 import Gemma3ForCausalLM, Gemma3TextModel, final_softcap
from shoal.models.vision.siglip import SiglipVisionEmbeddings, SiglipVisionTransformer
from shoal.models.vlm_common import TowerVLM, place_rows, vlm_configs

_VISION = "model.vision_tower.vision_model."
# Every spelling of the names to this model's: the Hub's checkpoints (language_model.model.*,
# vision_tower.vision_model.*), transformers 5's files and modules (model.vision_tower.* with
# no vision_model level).
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^(model\.)?language_model\.(model\.)?", "model.language_model."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?", _VISION),
    (r"^(model\.)?multi_modal_projector\.", "model.multi_modal_projector."))]


def canonical_name(name: str) -> str:
    for pattern, new in _RENAMES:
        if pattern.match(name):
            return pattern.sub(new, name, count=1)
    return name


# a piece's key cache slots [L] and sliding-window mask [n, L] (None: no window)
_Keys = tuple[torch.Tensor, torch.Tensor | None]


class ImageSpans:
    """The flat rows [a, b) of each image's soft tokens in one step, taken from the step's
    is_multimodal mask (a run of True is one image: each is wrapped in text markers)."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans
        # Triton metadata: the spans cut at request boundaries (read once a step) and, by
        # (KV cache group, window), each piece's key slots and mask, shared by the group's layers
        self._pieces: list[_Piece] | None = None
        self._keys: dict[tuple[int, int | None], list[_Keys]] = {}

    @classmethod
    def from_mask(cls, is_multimodal: torch.Tensor | None) -> ImageSpans | None:
        if is_multimodal is None:
            return None
        m = is_multimodal.to(device="cpu", dtype=torch.int8)
        edges = torch.diff(m, prepend=m.new_zeros(1), append=m.new_zeros(1))
        starts = (edges == 1).nonzero().flatten().tolist()
        ends = (edges == -1).nonzero().flatten().tolist()
        return cls(list(zip(starts, ends))) if starts else None

    def attend(self, attn: Attention, q: torch.Tensor, o: torch.Tensor,
               positions: torch.Tensor, md: Any) -> torch.Tensor:
        """o [T, Hq, D], the layer's causal output, with each span's rows recomputed; q:
        the layer's queries after norm and rotary. Run after the layer wrote its cache."""
        if isinstance(md, GroupedMetadata):
            md = md.of(attn.kv_group)
        if not isinstance(md, AttentionMetadata):
            return self._attend_triton(attn, q, o, md)
        for a, b in self.spans:
            while a < b:  # a run that crosses into the next request's rows is split there
                start, end, table = _request_rows(md, a)
                stop = min(b, end)
                o[a:stop] = _span_rows(attn, q[a:stop], positions, md, start, a, stop, table)
                a = stop
        return o

    def _attend_triton(self, attn: Attention, q: torch.Tensor, o: torch.Tensor, md: Any
                       ) -> torch.Tensor:
        from shoal.attention.triton_backend import TritonAttentionMetadata

        if not isinstance(md, TritonAttentionMetadata):
            raise TypeError(f"Gemma 3's bidirectional image attention reads the torch or Triton "
                            f"backend's metadata, got {type(md).__name__}")
        if self._pieces is None:
            self._pieces = _triton_pieces(self.spans, md)
        window = attn.sliding_window
        keys = self._keys.get((attn.kv_group, window))
        if keys is None:
            keys = [_piece_keys(p, md, window) for p in self._pieces]
            self._keys[(attn.kv_group, window)] = keys
        for p, (slots, mask) in zip(self._pieces, keys):
            o[p.a:p.b] = _attend_slots(attn, q[p.a:p.b], slots, mask)
        return o


@dataclass(frozen=True)
class _Piece:
    """Flat rows [a, b) of one image span inside one request's rows: that request's row of
    the Triton metadata and the position of row a."""

    a: int
    b: int
    row: int
    first: int


def _triton_pieces(spans: list[tuple[int, int]], md: Any) -> list[_Piece]:
    """The spans cut where a run crosses into the next request's rows. A row's position is
    its request's context plus its offset in the request's queries."""
    rows = md.num_decode_rows + md.num_prefills
    host = torch.cat([md.query_start_loc[:rows + 1], md.context_lens[:rows]]).tolist()
    starts, contexts = host[:rows + 1], host[rows + 1:]
    out = []
    for a, b in spans:
        while a < b:
            r = bisect.bisect_right(starts, a) - 1  # the request whose queries hold row a
            if not md.num_decode_rows <= r < rows:
                raise ValueError(f"image row {a} is not in a prefill chunk")
            stop = min(b, starts[r + 1])
            out.append(_Piece(a, stop, r, contexts[r] + a - starts[r]))
            a = stop
    return out


def _piece_keys(p: _Piece, md: Any, window: int | None) -> _Keys:
    """Cache slots of the keys rows [a, b) see (their request's, through row b - 1; from the
    window's start for row a on a sliding layer) and the window's mask [n, L] (None without
    one)."""
    bs, device = md.block_size, md.block_tables.device
    end = p.first + p.b - p.a  # one past row b - 1's position
    lo = 0 if window is None else max(0, p.first - window + 1)
    kpos = torch.arange(lo, end, device=device)
    slots = md.block_tables[p.row].long()[kpos // bs] * bs + kpos % bs
    if window is None:
        return slots, None
    qpos = torch.arange(p.first, end, device=device)
    return slots, kpos[None, :] > qpos[:, None] - window


def _request_rows(md: AttentionMetadata, row: int) -> tuple[int, int, torch.Tensor | None]:
    """(first row, end row, block table) of the prefill holding flat row `row`; the table is
    None for a fresh prompt (its keys are all this step's rows)."""
    for start, n in md.fresh_spans:
        if start <= row < start + n:
            return start, start + n, None
    if md.prefill_token_index is not None:
        starts = md.prefill_token_index[:, 0].tolist()
        lens = md.prefill_token_valid.sum(1).tolist()
        for p, (s, n) in enumerate(zip(starts, lens)):
            if s <= row < s + n:
                return s, s + n, md.prefill_block_tables[p]
    raise ValueError(f"image row {row} is not in a prefill chunk")


def _span_rows(attn: Attention, q: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata, start: int, a: int, b: int,
               table: torch.Tensor | None) -> torch.Tensor:
    """Rows [a, b) (one image span of the request whose rows start at `start`) over every key
    up to the span's end: causal context and span keys alike, within the window if any."""
    window, bs = attn.sliding_window, md.block_size
    if table is None:
        slots, kpos = md.slot_mapping[start:b], positions[start:b]
    else:
        lo = 0 if window is None else max(0, int(positions[a]) - window + 1)
        kpos = torch.arange(lo, int(positions[b - 1]) + 1, device=positions.device)
        slots = table[kpos // bs] * bs + kpos % bs
    mask = None
    if window is not None:  # the span's future keys are all inside it
        mask = kpos[None, :] > positions[a:b, None] - window
    return _attend_slots(attn, q, slots, mask)


def _attend_slots(attn: Attention, q: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """q [n, Hq, D] over the keys and values at cache slots [L] of the layer's paged cache."""
    cache = attn.kv_cache
    assert cache is not None
    k, v = cache[0][slots], cache[1][slots]  # [L, Hk, D]
    if kv_quant.is_fp8(cache):
        k = kv_quant.dequantize(k, attn.k_scale, q.dtype)
        v = kv_quant.dequantize(v, attn.v_scale, q.dtype)
    return _attention(q, k, v, mask, attn.scale, attn.softcap)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None) -> torch.Tensor:
    """q [n, Hq, D], k, v [L, Hk, D], mask [n, L] (True: attend) or None -> [n, Hq, D]."""
    hq, hk = q.shape[1], k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if not softcap:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                           enable_gqa=hq != hk)
        return o[0].transpose(0, 1)
    kh, vh = kh.repeat_interleave(hq // hk, 1), vh.repeat_interleave(hq // hk, 1)
    scores = torch.tanh(torch.matmul(qh, kh.transpose(-1, -2)).float() * scale / softcap)
    scores = scores * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    o = torch.matmul(torch.softmax(scores, -1).to(vh.dtype), vh)
    return o[0].transpose(0, 1)


class _PlainPositions(SiglipVisionEmbeddings):
    """Gemma 3's SigLIP: whole images of the trained size, patch i at position i."""

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        n, gh, gw = patch_mask.shape
        if gh * gw != self.side ** 2:
            raise ValueError(f"a {gh} x {gw} patch grid; the tower was trained on "
                             f"{self.side} x {self.side}")
        return torch.arange(gh * gw, device=patch_mask.device).expand(n, -1)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any, text_hidden: int, dtype: torch.dtype,
                 use_triton_ops: bool) -> None:
        super().__init__()
        vision = config.vision_config
        self.side = int(vision.image_size) // int(vision.patch_size)
        per_side = int(round(int(config.mm_tokens_per_image) ** 0.5))
        if per_side ** 2 != config.mm_tokens_per_image or self.side % per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool "
                             f"a {self.side} x {self.side} patch grid")
        self.kernel = self.side // per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text_hidden, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = OffsetRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype,
                                              use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, side * side, Dv] patch features -> [n, mm_tokens_per_image, Dt]."""
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, text: Any, dtype: torch.dtype, use_triton_ops: bool):
        super().__init__()
        vision = config.vision_config
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = SiglipVisionTransformer(vision, dtype)
        self.vision_tower.vision_model.embeddings = _PlainPositions(vision, dtype)
        self.vision_tower.requires_grad_(False)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, text.hidden_size, dtype,
                                                               use_triton_ops)
        self.language_model = Gemma3TextModel(text, dtype, use_triton_ops)


class Gemma3ForConditionalGeneration(TowerVLM):
    label: ClassVar[str] = "Gemma 3"
    vision_prefix: ClassVar[str] = _VISION
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        Gemma3ForCausalLM.packed_modules_mapping)

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        config, text = vlm_configs(hf_config, self.label)
        self.config = text
        self.hidden_size = text.hidden_size
        self.image_token_id = int(config.image_token_index)
        self.model = Gemma3Model(config, text, dtype, use_triton_ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.tied_head(text, dtype)
        # the image spans of the step embed_input_ids last saw, for the forward that follows
        self._spans: ImageSpans | None = None

    # ---- images -----------------------------------------------------------------------------
    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, hidden] tensor per image; the tower runs once over all."""
        if not features:
            return []
        device = self.lm_head.weight.device
        pixels = torch.cat([torch.tensor(f.arrays()["pixel_values"]) for f in features])
        feats = self.model.vision_tower.vision_model(pixels.to(device))
        return list(self.model.multi_modal_projector(feats).unbind(0))

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled token embeddings, image rows replaced (unscaled, as transformers
        places them); records the step's image spans for forward."""
        if mm_embeds is not None and is_multimodal is not None:
            self._spans = ImageSpans.from_mask(is_multimodal)
        return place_rows(self.model.language_model.embed(input_ids), mm_embeds, is_multimodal)

    # ---- text -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # spans belong to the embeddings they came with: a step without them has none
        spans, self._spans = (self._spans if inputs_embeds is not None else None), None
        return self.model.language_model(input_ids, positions, attn_metadata,
                                         inputs_embeds=inputs_embeds, spans=spans)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_softcap(self.config, self.lm_head.compute_logits(hidden))

    def text_model(self) -> nn.Module:
        return self.model.language_model

    def vision_tower(self) -> nn.Module:
        return self.model.vision_tower.vision_model

    def canonical_name(self, name: str) -> str:
        return canonical_name(name)

    def keep_vision(self, name: str) -> bool:
        """A SigLIP pooling head is skipped: Gemma 3 reads the tower's last hidden states,
        never the head."""
        return not name.startswith("head.")
