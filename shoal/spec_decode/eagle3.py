"""Method "eagle3": an EAGLE-3 draft head for a Llama-family target, run by mtp.py's
HiddenStateDrafter machinery (mirror, KV cache of its own, greedy steps, CUDA graphs).

The target records, in the same forward pass, the residual stream (hidden + residual)
entering three of its layers (LlamaModel.record_aux; by default layers 2, L // 2 and L - 3 as
vLLM's and SGLang's, else the head config's eagle_config.eagle_aux_hidden_state_layer_ids,
read as vLLM reads them). Under pipeline parallelism every stage records those of its own
layers (record_stage_aux on the stages that build no drafter), and they reach stage 0, which
drafts, behind the final hidden states (shoal/distributed/stage_aux.py, worker/
stage_link.py). For the token t at position p + 1 and those states a_1..a_3 at p:

    g = fc(cat([a_1, a_2, a_3]))                       # fc: [H, 3 * H_target], no bias
    e = input_layernorm(embed(t)); n = hidden_norm(g)  # residual: g (n: norm_before_residual)
    x = attn(cat([e, n])) at position p                # q/k/v read 2 * H
    x, r = post_attention_layernorm(x, g); y = mlp(x) + r
    logits = lm_head(norm(y))                          # over the draft vocabulary

y is also what a further draft step feeds back in place of g. A draft id d is the target's
d + d2t[d]. The embedding is the target's unless the checkpoint stores a different one.

Checkpoint (as the EAGLE-3 heads vLLM and SGLang load, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-
8B): config.json (LlamaForCausalLMEagle3, num_hidden_layers 1, the target's hidden_size and
vocab_size, draft_vocab_size) and *.safetensors (or pytorch_model*.bin) with fc.weight,
midlayer.{self_attn,mlp}.*, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.
weight, norm.weight, lm_head.weight, d2t (t2d, unused), optionally embed_tokens.weight
("layers.0." for "midlayer." and a leading "model." are accepted)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.distributed.parallel_state import get_tp_world_size
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    default_weight_loader,
    load_tensor,
    packed_target,
)
from shoal.layers.norm import RMSNorm
from shoal.loader.dummy import initialize_dummy_weights
from shoal.loader.safetensors_loader import load_folder_config
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from shoal.spec_decode.eagle_head import read_eagle_tensors
from shoal.spec_decode.kept_rows import KeptStep
from shoal.spec_decode.mirror_backlog import RawRows
from shoal.spec_decode.mtp import HiddenStateDrafter
from shoal.worker.drafter import TargetStep

logger = logging.getLogger(__name__)

_PACKED = LlamaForCausalLM.packed_modules_mapping
_ERR = "speculative_config: method 'eagle3'"


class Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's decoder layer: attention over [normed embedding; normed fused state]."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool):
        super().__init__(cfg, dtype, False, False, use_triton_ops, layer=0)
        heads = cfg.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(  # q, k and v read [embed; hidden]
            2 * cfg.hidden_size, self.self_attn.head_dim, heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            bias=bool(getattr(cfg, "attention_bias", False)), params_dtype=dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor, md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(positions, torch.cat([embeds, normed], dim=-1), md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaHead(nn.Module):
    """The head (see the module docstring); a DraftHead for HiddenStateDrafter whose
    compute_logits are over the draft vocabulary (to_target maps its ids)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, num_aux: int, target_hidden: int,
                 use_triton_ops: bool = True):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        self.fc = ReplicatedLinear(num_aux * target_hidden, h, bias=False, params_dtype=dtype)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, dtype, use_triton_ops)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux hidden states -> the head's input state."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any) -> torch.Tensor:
        x, residual = self.layers[0](positions, self.embed_tokens(input_ids), prev_hidden, md)
        return x + residual  # pre-norm: what the next draft step feeds back

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[Any]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, tensors: dict[str, torch.Tensor], target: nn.Module) -> None:
        """Renamed checkpoint tensors (renamed_eagle3); the embedding falls back to (and is
        shared with, when equal) the target's. Raises on unknown or missing tensors."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors.items():
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.long))
                continue
            if name == "embed_tokens.weight":
                theirs = target.model.embed_tokens.weight
                if tensor.shape == theirs.shape and torch.equal(
                        tensor.to(theirs.dtype), theirs.detach().cpu()):
                    continue  # a frozen copy of the target's: shared below
            dst, shard = packed_target(name, _PACKED)
            param = params.get(dst)
            if param is None:
                raise ValueError(f"{_ERR}: checkpoint tensor {name!r} has no matching "
                                 "parameter in the EAGLE-3 head")
            # (Under tensor parallelism a sharded parameter's loader checks its slice.)
            if shard is None and tuple(param.shape) != tuple(tensor.shape) and (
                    get_tp_world_size() == 1 or not _sharded(param)):
                raise ValueError(f"{_ERR}: checkpoint tensor {name!r} has shape "
                                 f"{list(tensor.shape)}, the head expects {list(param.shape)}")
            load_tensor(param, tensor.to(param.dtype), shard)
            loaded.add(dst)
        if "embed_tokens.weight" not in loaded:
            self.embed_tokens.weight = target.model.embed_tokens.weight
            loaded.add("embed_tokens.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"{_ERR}: the EAGLE-3 checkpoint lacks {missing[:5]}")


def _sharded(param: nn.Parameter) -> bool:
    """A parameter whose loader takes this rank's slice of the checkpoint tensor."""
    return getattr(param, "weight_loader", default_weight_loader) is not default_weight_loader


def renamed_eagle3(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as Eagle3LlamaHead's: a leading "model." dropped, midlayer. -> layers.0.; t2d
    (the head never maps target ids to draft ids) and rotary buffers skipped."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name == "t2d" or "rotary_emb.inv_freq" in name:
            continue
        out[name] = tensor
    return out


def aux_layer_ids(head_cfg: Any, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream the head reads (num_layers: the
    last layer's output)."""
    eagle = getattr(head_cfg, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(0 <= i <= num_layers for i in ids):
        raise ValueError(f"{_ERR}: aux hidden state layers {list(ids)} do not fit a target of "
                         f"{num_layers} layers (three ids in [0, {num_layers}] are needed)")
    return ids


def _head_config(folder: Path, target_cfg: Any, max_model_len: int) -> Any:
    try:
        cfg = load_folder_config(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"{_ERR}: cannot read {folder}'s config.json ({e})") from e
    h, v = target_cfg.hidden_size, target_cfg.vocab_size
    for key, want in (("hidden_size", h), ("vocab_size", v), ("target_hidden_size", h)):
        mine = getattr(cfg, key, None)
        if mine != want and not (key == "target_hidden_size" and mine is None):
            raise ValueError(f"{_ERR}: the EAGLE-3 head {str(folder)!r} has {key}={mine}, "
                             f"the target {want}; they must be the same")
    if int(getattr(cfg, "num_hidden_layers", 0) or 0) != 1:
        raise ValueError(f"{_ERR}: only one-layer EAGLE-3 heads are supported ({folder} has "
                         f"num_hidden_layers={getattr(cfg, 'num_hidden_layers', None)})")
    cfg = copy.deepcopy(cfg)
    dv = getattr(cfg, "draft_vocab_size", None) or v
    if not 1 <= dv <= v:
        raise ValueError(f"{_ERR}: draft_vocab_size={dv} must be in [1, vocab_size={v}]")
    cfg.draft_vocab_size = dv
    if getattr(cfg, "max_position_embeddings", 0) < max_model_len:
        if getattr(cfg, "original_max_position_embeddings", None) is None:
            cfg.original_max_position_embeddings = cfg.max_position_embeddings
        cfg.max_position_embeddings = max_model_len  # the rotary table reaches the target's
    return cfg


def _check_tensors(tensors: dict[str, torch.Tensor], cfg: Any, folder: Path,
                   fc_in: int) -> None:
    fc = tensors.get("fc.weight")
    if fc is None:
        raise ValueError(f"{_ERR}: {folder} is not an EAGLE-3 head (no fc.weight tensor)")
    if tuple(fc.shape) != (cfg.hidden_size, fc_in):
        raise ValueError(f"{_ERR}: {folder}'s fc.weight has shape {list(fc.shape)}; an "
                         f"EAGLE-3 head over this target needs [{cfg.hidden_size}, {fc_in}] "
                         "(three target hidden states in)")
    d2t = tensors.get("d2t")
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if dv != v:
            raise ValueError(f"{_ERR}: {folder} has no d2t tensor (the draft -> target id "
                             f"map), which a draft vocabulary of {dv} < {v} needs")
        return
    if tuple(d2t.shape) != (dv,):
        raise ValueError(f"{_ERR}: {folder}'s d2t has shape {list(d2t.shape)}, expected "
                         f"[{dv}] (draft_vocab_size)")
    mapped = torch.arange(dv) + d2t.to(torch.long)
    if int(mapped.min()) < 0 or int(mapped.max()) >= v:
        raise ValueError(f"{_ERR}: {folder}'s d2t maps draft ids outside the target's "
                         f"vocabulary [0, {v})")


def _head_folder_config(config: EngineConfig, spec: SpeculativeConfig, target: nn.Module,
                        loaded: Any) -> tuple[Path, Any, tuple[int, ...]]:
    """The head's folder, its config and the target layers it reads (checked)."""
    if not isinstance(target, LlamaForCausalLM):
        raise ValueError(f"{_ERR} drafts for Llama-family targets (LlamaForCausalLM and its "
                         f"kin), not {type(target).__name__}")
    folder = Path(spec.model or "").expanduser()
    if not spec.model or not folder.is_dir():
        raise ValueError(f"{_ERR} needs a local folder with the EAGLE-3 head's config.json "
                         f"and weights; {spec.model!r} is none (shoal never downloads)")
    hf = loaded.hf_config
    cfg = _head_config(folder, hf, config.scheduler_config.max_model_len)
    return folder, cfg, aux_layer_ids(cfg, hf.num_hidden_layers)


def record_stage_aux(config: EngineConfig, spec: SpeculativeConfig, target: nn.Module,
                     loaded: Any) -> None:
    """A pipeline stage after the first (no drafter): its target records the aux states
    of its own layers that the head reads."""
    _record_aux(config, spec, target, _head_folder_config(config, spec, target, loaded)[2])


def _record_aux(config: EngineConfig, spec: SpeculativeConfig, target: nn.Module,
                ids: tuple[int, ...]) -> None:
    sc = config.scheduler_config
    max_tokens = max(sc.max_num_batched_tokens,
                     sc.max_num_seqs * (spec.num_speculative_tokens + 1))
    target.model.record_aux(ids, max_tokens)


def build_eagle3_head(config: EngineConfig, spec: SpeculativeConfig, target: nn.Module,
                      loaded: Any) -> tuple[Eagle3LlamaHead, tuple[int, ...]]:
    """The EAGLE-3 head of spec.model for `target`, and the target layers it reads."""
    folder, cfg, ids = _head_folder_config(config, spec, target, loaded)
    hf = loaded.hf_config
    dummy = config.model_config.load_format == "dummy"
    tensors = {} if dummy else renamed_eagle3(read_eagle_tensors(folder))
    if not dummy:
        _check_tensors(tensors, cfg, folder, len(ids) * hf.hidden_size)
    dtype = config.model_config.dtype
    with torch.device(config.device):
        head = Eagle3LlamaHead(cfg, dtype, len(ids), hf.hidden_size, config.use_triton_ops)
    if dummy:
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.embed_tokens.weight = target.model.embed_tokens.weight
    else:
        head.load_weights(tensors, target)
    logger.info("eagle3: head from %s reading target layers %s (draft vocabulary %d)",
                folder, ids, cfg.draft_vocab_size)
    return head.eval(), ids


class Eagle3Drafter(HiddenStateDrafter):
    """HiddenStateDrafter over the target's aux hidden states (fused by the head's fc at
    launch, or in the mirror's graph) instead of its final ones, with draft ids mapped to the
    target's."""

    graph_mirror = True

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: nn.Module,
                 loaded: Any):
        head, ids = build_eagle3_head(config, spec, target, loaded)
        super().__init__(config, spec, head)
        self.target_model = target.model
        _record_aux(config, spec, target, ids)

    @torch.inference_mode()
    def on_launch(self, step: TargetStep) -> torch.Tensor | RawRows | KeptStep | None:
        """fc over the step's aux states, queued now: the buffer they sit in is the next
        step's too (a new tensor comes out, so async scheduling needs no copy); a copy of
        them where the mirror runs the fc (paused requests, mirror graphs). Pipeline
        parallelism: every stage's, gathered once the step is back (step.aux)."""
        if step.hidden is None:
            return None
        aux, own = step.aux, step.aux is not None  # own: a tensor no later step writes
        if aux is None and step.rows is not None:
            # A verify graph pads each request's tokens to its q: the aux rows sit where it
            # wrote them, not in the step's flat order (step.hidden's, inp.starts()).
            aux, own = self.target_model.aux_buffer.index_select(0, step.rows), True
        elif aux is None:
            aux = self.target_model.aux_buffer[:step.hidden.shape[0]]
        # Paused requests' rows wait unmirrored (mirror_backlog.py), the fc with them: the
        # mirror runs it over the rows it mirrors. A step of paused requests only is kept
        # whole in the ring of kept rows (one copy, as the clone below). The mirror's graphs
        # run the fc themselves (mirror_graphs.py).
        kept = self._keep_step(step, aux)
        if kept is not None:
            return kept
        # Raw rows (3x the fc's output) are kept only where a mirror graph can take the step:
        # a long prefill chunk's would be held unprofiled through the next step's forward.
        graphs = self.mirror_graphs
        graphed = graphs is not None and aux.shape[0] <= graphs.max_tokens
        if graphed or any(it.drafts_paused or 0 in it.draft_limits
                          for it in step.inputs.items):  # (rows the finish may keep)
            return RawRows(aux if own else aux.clone())
        return self.model.combine(aux)

    def _input_states(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.combine(rows)

    def _raw_width(self) -> int:
        return int(self.model.fc.weight.shape[1])  # the aux states of three target layers

    def _graph_source(self, hidden: torch.Tensor | RawRows | KeptStep) -> torch.Tensor | None:
        # (a plain tensor went through the fc at launch: the graphs run it on raw rows)
        return hidden.rows if isinstance(hidden, RawRows) else None

    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.to_target(self.model.compute_logits(h).argmax(dim=-1))

