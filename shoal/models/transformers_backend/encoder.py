"""Encoder-only models through the Transformers backend: transformers' BERT-like classes that
shoal has no class of its own for (DistilBERT, ELECTRA, ModernBERT, XLM-R with another head,
...; or BERT itself under model_impl="transformers"), run as pooling models
(shoal/models/interface.py's PoolingModel) by the pooling runner.

The pooling runner packs a step's whole prompts back to back. Where the modeling code takes a
custom attention function (support.packs_prompts), the base model runs them as one [1, T]
sequence. Its attention modules call the backend's attention function, which
attends bidirectionally within each prompt (encoder_attention.py: no KV cache, no
cross-prompt attention, a module's sliding window kept). Positions restart per prompt as
position_ids, numbered as the model numbers them itself (RoBERTa's start after the padding
index: the offset is read off a probe pass); segment ids go in as token_type_ids where the
base model takes them. Where it takes none (MPNet, DeBERTa-v2/v3, RoFormer, ...),
transformers' own forward runs over padded batches of the prompts with an attention mask
(encoder_padded.py: its limits on padding and memory), and the packed states it gives back
are pooled and classified the same way.

TransformersEncoderModel embeds: the checkpoint's class is built (its heads pruned on the
meta device, so a masked-LM checkpoint's base model keeps its own layout) and its base model
kept. TransformersEncoderForSequenceClassification keeps the whole classifier; classify()
runs the checkpoint's own head over the pooled token (a view of the model whose base model
returns the given states, with the base's pooler over them where it has one).

Tensor parallelism follows the config's base_model_tp_plan as for decoders
(tensor_parallel.py: EuroBERT's, for one); an encoder whose config has none (BERT, DistilBERT,
ModernBERT, ...) is refused by name at tensor_parallel_size > 1, and so is one run over
padded batches (transformers' own attention sizes its heads from the config, not the shard).

Not here: pipeline parallelism (refused), attention soft-capping or sinks,
modeling code that mixes tokens outside the attention function (refused where a layer never
calls it), per-token and span heads (support.py refuses them)."""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.attention.packed import PackedSeqs
from shoal.distributed.parallel_state import get_pp_world_size, get_tp_world_size
from shoal.models.interface import PoolingModelBase, SequenceClassifierBase
from shoal.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    AttentionCall,
    packed_step_context,
    probe_attention,
)
from shoal.models.transformers_backend.build import adopt, build_model
from shoal.models.transformers_backend.encoder_attention import PackedStep
from shoal.models.transformers_backend.encoder_padded import PaddedEncoder
from shoal.models.transformers_backend.model import check_local_heads
from shoal.models.transformers_backend.support import (
    check_supported,
    encoder_checkpoint_class,
    is_encoder_only,
    is_sequence_classifier,
    packs_prompts,
)
from shoal.models.transformers_backend.tensor_parallel import TPPlan, apply_tp_plan, tp_plan
from shoal.models.transformers_backend.weights import load_checkpoint

logger = logging.getLogger(__name__)

# Tokens of the construction-time probe pass (several, so positions show their numbering).
_PROBE_TOKENS = 3


class TransformersEncoderModel(nn.Module, PoolingModelBase):
    """An encoder's embeddings: its base model's final hidden states, pooled by the runner
    (CLS unless the sentence-transformers files or pooler_config say otherwise)."""

    is_causal: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "CLS"
    tie_word_embeddings = False
    # transformers' parameters are the checkpoint's own, unfused
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        """use_triton_ops has no effect: the layers are transformers'."""
        super().__init__()
        check_supported(hf_config, "pooling")
        cls = encoder_checkpoint_class(hf_config)
        self.architecture = cls.__name__
        if not is_encoder_only(hf_config):
            raise self._refusal("its config is not an encoder-only model's")
        classifier = isinstance(self, SequenceClassifierBase)
        if classifier != is_sequence_classifier(hf_config):
            raise self._refusal(f"{type(self).__name__} does not build this checkpoint class")
        if get_pp_world_size() > 1:
            raise self._refusal("pipeline parallelism (an encoder runs in one stage)")
        packed = packs_prompts(cls)
        tp = get_tp_world_size()
        if tp > 1 and not packed:
            raise self._refusal("tensor parallelism: its modeling code takes no custom "
                                "attention function, so it runs whole, over padded batches")
        # (ValueError naming the architecture where the config has no plan that splits it)
        plan = tp_plan(hf_config, tp) if tp > 1 else None
        # A task checkpoint's tensors carry the base model's prefix; what else it holds
        # belongs to heads an embedder does not build.
        self._task_checkpoint = not classifier and not _is_base_model(cls)
        hf = build_model(cls._from_config, hf_config, dtype, torch.get_default_device(),
                         None if classifier else _base_model,
                         ATTN_IMPLEMENTATION if packed else None)
        if plan is not None:  # (it names base-model layers: a classifier's head stays whole)
            apply_tp_plan(hf, plan)
        # (parameter names are the checkpoint's, less the base prefix for an embedder)
        adopt(self, hf)
        self.config = hf_config
        self.dtype = dtype
        self.__dict__["base"] = hf.base_model
        # (without the base prefix: checkpoints name them either way)
        self._buffer_names = {name.removeprefix(f"{hf.base_model_prefix}.")
                              for name, _ in hf.named_buffers()}
        self.padded: PaddedEncoder | None = None
        if not packed:
            self.padded = PaddedEncoder(self.base, hf_config, self.architecture)
            self.hidden_size = self.padded.hidden_size
            logger.info("%s runs over padded batches (its modeling code takes no custom "
                        "attention function)%s", self.architecture,
                        "" if self.padded.pads else ", one prompt length per batch")
            return
        self.hidden_size = int(hf_config.hidden_size)
        accepts = inspect.signature(self.base.forward).parameters
        if "position_ids" not in accepts:
            raise self._refusal(f"{type(self.base).__name__}.forward takes no position_ids, so "
                                "positions cannot restart at each packed prompt")
        self._takes_token_types = "token_type_ids" in accepts
        self._takes_use_cache = "use_cache" in accepts
        self.position_offset = self._probe(hf_config, plan)

    def _refusal(self, reason: str) -> ValueError:
        return ValueError(f"the Transformers backend cannot run {self.architecture}: {reason}")

    def train(self, mode: bool = True) -> TransformersEncoderModel:
        self.hf_model.train(mode)
        return super().train(mode)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        """[T] packed prompts -> [T, hidden_size] final hidden states."""
        if self.padded is not None:  # (positions are the model's own: right padding)
            return self.padded(input_ids, attn_metadata)
        with packed_step_context(PackedStep(attn_metadata)):
            return self._run(input_ids, positions + self.position_offset,
                             attn_metadata.token_type_ids)

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
             token_type_ids: torch.Tensor | None) -> torch.Tensor:
        kw: dict[str, Any] = {"input_ids": input_ids.unsqueeze(0)}
        if position_ids is not None:
            kw["position_ids"] = position_ids.unsqueeze(0)
        if self._takes_token_types:
            # (zeros rather than the model's buffer, which holds max_position_embeddings
            # entries: a packed step may be longer). A model without segment embeddings
            # ignores a pair's segment ids, as transformers does.
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            kw["token_type_ids"] = types.unsqueeze(0)
        if self._takes_use_cache:
            kw["use_cache"] = False
        return self.base(**kw)[0][0]

    def _probe(self, hf_config: Any, plan: TPPlan | None) -> int:
        """One pass over a made-up prompt with positions left to the model: checks what its
        attention modules pass (bidirectional, no masks of their own, every layer attends,
        this rank's share of the heads under a tensor-parallel plan) and returns where its
        position numbering starts (0; RoBERTa's padding index + 1)."""
        ids = torch.full((_PROBE_TOKENS,), _probe_token(hf_config), dtype=torch.long,
                         device=next(self.hf_model.parameters()).device)
        seen: list[torch.Tensor] = []
        hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
                 for name, m in self.base.named_modules()
                 if isinstance(m, nn.Embedding) and name.endswith("position_embeddings")]
        try:
            with torch.no_grad():
                calls = probe_attention(lambda: self._run(ids, None, None))
        finally:
            for h in hooks:
                h.remove()
        self._check_calls(calls, getattr(hf_config, "num_hidden_layers", None))
        if plan is not None:
            check_local_heads(calls, hf_config, plan, self.architecture)
        if not seen:  # no absolute position embeddings (rotary, relative): from 0
            return 0
        pos = seen[0].reshape(-1)
        start = int(pos[0])
        if not torch.equal(pos, torch.arange(start, start + len(pos), device=pos.device)):
            raise self._refusal(f"it numbers a prompt's positions {pos.tolist()}, not "
                                "consecutively, so they cannot be given per packed prompt")
        return start

    def _check_calls(self, calls: list[AttentionCall], num_layers: int | None) -> None:
        if not calls:
            raise self._refusal("its forward pass never called the attention interface")
        if isinstance(num_layers, int) and len(calls) < num_layers:
            raise self._refusal(f"only {len(calls)} of its {num_layers} layers call attention; "
                                "the others mix tokens another way, which would mix the "
                                "packed prompts")
        for c in calls:
            name = type(c.module).__name__
            if c.is_causal:
                raise self._refusal(f"{name} attends causally, not bidirectionally as an "
                                    "encoder's config says")
            if c.own_mask:
                raise self._refusal(f"{name} builds an attention mask of its own, which "
                                    "packed attention does not apply")
            if c.softcap:
                raise self._refusal(f"{name} soft-caps attention, which packed attention "
                                    "does not apply")
            if c.num_heads % c.num_kv_heads:
                raise self._refusal(f"{c.num_heads} query heads over {c.num_kv_heads} KV "
                                    "heads")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self.hf_model, weights, self._owns)

    def _owns(self, key: str) -> bool:
        """Whether a checkpoint tensor with no place in the model is an error (True) or
        skipped: a buffer the model computes itself (position_ids of older checkpoints), a
        key the class ignores on load, the heads of a task checkpoint an embedder dropped."""
        hf = self.hf_model
        prefix = f"{hf.base_model_prefix}."
        if key.removeprefix(prefix) in self._buffer_names:
            return False
        for pattern in getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ():
            if re.search(pattern, key):
                return False
        return not self._task_checkpoint or key.startswith(f"{hf.base_model_prefix}.")


class TransformersEncoderForSequenceClassification(TransformersEncoderModel,
                                                    SequenceClassifierBase):
    """An encoder's ...ForSequenceClassification checkpoint: classify (and score with one
    label, a cross-encoder) through its own head over the pooled token."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        self.num_labels = int(hf_config.num_labels)
        self.classifier_pooling_type = classifier_pooling(hf_config)
        self.__dict__["head_view"] = head_only_view(self.hf_model)
        try:
            with torch.no_grad():  # (parameters are zeros here: only the shape is checked)
                logits = self.classify(torch.zeros(2, self.hidden_size, dtype=dtype,
                                                   device=next(self.parameters()).device))
        except Exception as e:  # (whatever the modeling code raises: a refusal naming it)
            raise self._refusal(f"its classification head does not run over the pooled "
                                f"token alone ({type(e).__name__}: {e}): it reads more of the "
                                "base model's inputs or outputs") from e
        if tuple(logits.shape) != (2, self.num_labels):
            raise self._refusal(f"its classification head gives logits of shape "
                                f"{tuple(logits.shape)} for 2 pooled tokens, not "
                                f"(2, {self.num_labels}): it reads the base model's output "
                                "in a way the pooled token does not give")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled states -> [N, num_labels] logits of the checkpoint's head."""
        return self.head_view(inputs_embeds=pooled.unsqueeze(1)).logits


def classifier_pooling(hf_config: Any) -> str:
    """The token(s) the checkpoint's head reads: ModernBERT's classifier_pooling ("cls" or
    "mean"), else the first ([CLS]) token, as BERT-like heads do."""
    mode = getattr(hf_config, "classifier_pooling", "cls")
    if mode not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling {mode!r} is not supported (cls or mean)")
    return mode.upper()


class _GivenStates(nn.Module):
    """Stands in for the base model in head_only_view: the states handed in as inputs_embeds
    are its last hidden states; its pooler_output is the base's pooler over them (BERT's
    dense + tanh over the first token), where the base has one."""

    def __init__(self, pooler: nn.Module | None):
        super().__init__()
        self.__dict__["pooler"] = pooler  # (not registered: the parameters are the model's)

    def forward(self, *args: Any, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if inputs_embeds is None:
            raise ValueError("the classification head's view expects its states as "
                             "inputs_embeds")
        pooled = self.pooler(inputs_embeds) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=inputs_embeds,
                                          pooler_output=pooled)


def head_only_view(model: nn.Module) -> nn.Module:
    """A shallow copy of a ...ForSequenceClassification model (its parameters shared) whose
    base model is _GivenStates: calling it with inputs_embeds=[N, 1, H] pooled states runs
    the checkpoint's own head code over them."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    pooler = getattr(model.base_model, "pooler", None)
    view._modules[model.base_model_prefix] = _GivenStates(
        pooler if isinstance(pooler, nn.Module) else None)
    return view


def _base_model(model: nn.Module) -> nn.Module:
    """What an embedder keeps of its checkpoint's class: the base model."""
    return model.base_model


def _is_base_model(cls: type) -> bool:
    """The checkpoint class is the base model itself (its tensors carry no prefix)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING.get(cls.config_class, None) is cls


def _probe_token(hf_config: Any) -> int:
    """A token id that is not padding (RoBERTa numbers pad tokens apart)."""
    pad = getattr(hf_config, "pad_token_id", None)
    return 1 if pad != 1 else 2
