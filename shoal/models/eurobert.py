"""EuroBERT encoders for pooling: `EuroBertModel` and `EuroBertForMaskedLM` (the pretrained
checkpoints, served as embedders), `EuroBertForSequenceClassification`, and
`JinaEmbeddingsV5Model` with a EuroBERT backbone (jina-embeddings-v5-text-nano).

EuroBERT is a Llama stack run bidirectionally: RMSNorm, rotary positions, grouped-query
attention, a SiLU-gated MLP, a final norm, and no causal mask. It reuses LlamaModel as is;
attention over a pooling step's packed prompts (shoal/attention/packed.py) is bidirectional
because the pooling runner reads `is_causal = False` from the model. Embeddings pool MEAN by
default (EuroBERT has no [CLS] objective); a checkpoint's sentence-transformers files say
otherwise where they exist (jina v5's say last-token)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from shoal.attention.packed import PackedSeqs
from shoal.layers.linear import default_weight_loader, load_tensor, packed_target
from shoal.models.interface import PoolingModelBase, SequenceClassifierBase
from shoal.models.llama import LlamaForCausalLM, LlamaModel

# the encoder's own tensor names; a bare EuroBertModel checkpoint stores them without "model."
_ENCODER_NAMES = ("layers.", "embed_tokens.", "norm.")


def check_eurobert_config(cfg: Any) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"EuroBERT hidden_act {act!r} is not supported (silu only)")


def encoder_name(name: str) -> str:
    """A checkpoint tensor's name with the encoder under `model.`, as the classes here hold it."""
    return "model." + name if name.startswith(_ENCODER_NAMES) else name


def load_eurobert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                          ignored: tuple[str, ...]) -> set[str]:
    """HF-named tensors into `model` (q/k/v and gate/up fused); `ignored`: heads not served."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(ignored) or "rotary_emb.inv_freq" in name:
            continue
        target, shard = packed_target(encoder_name(name), model.packed_modules_mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{type(model).__name__}")
        load_tensor(param, tensor, shard)
        loaded.add(target)
    return loaded


class EuroBertModel(nn.Module, PoolingModelBase):
    """The encoder; its final (normed) hidden states are pooled by the pooling runner."""

    is_causal = False
    default_pooling_type = "MEAN"
    tie_word_embeddings = False
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = \
        LlamaForCausalLM.packed_modules_mapping
    _ignored_prefixes: ClassVar[tuple[str, ...]] = ("lm_head.",)  # the MLM head

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        check_eurobert_config(hf_config)
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.model = LlamaModel(hf_config, dtype, use_triton_ops=use_triton_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_eurobert_weights(self, weights, self._ignored_prefixes)


class EuroBertForMaskedLM(EuroBertModel):
    """EuroBERT's pretrained checkpoints (EuroBERT/EuroBERT-210m...) as embedders: the
    encoder alone, the masked-LM head left unread."""


class EuroBertForSequenceClassification(nn.Module, SequenceClassifierBase):
    """The encoder, then dense + GELU + a linear classifier, pooled as the config's
    classifier_pooling says: "bos" (the first token), "mean" (of the hidden states), or
    "late" (transformers' default: the head on every token, its logits averaged)."""

    is_causal = False
    default_pooling_type = "MEAN"
    tie_word_embeddings = False
    packed_modules_mapping = EuroBertModel.packed_modules_mapping
    POOLINGS = ("bos", "mean", "late")

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        check_eurobert_config(hf_config)
        self.pooling = getattr(hf_config, "classifier_pooling", "late")
        if self.pooling not in self.POOLINGS:
            raise ValueError(f"EuroBERT classifier_pooling must be one of "
                             f"{', '.join(self.POOLINGS)} (got {self.pooling!r})")
        self.classifier_pooling_type = "CLS" if self.pooling == "bos" else "MEAN"
        self.config = hf_config
        self.hidden_size = h = hf_config.hidden_size
        self.num_labels = int(getattr(hf_config, "num_labels", 2))
        self.model = LlamaModel(hf_config, dtype, use_triton_ops=use_triton_ops)
        self.dense = nn.Linear(h, h, dtype=dtype)
        self.classifier = nn.Linear(h, self.num_labels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        hidden = self.model(input_ids, positions, attn_metadata)
        if self.pooling == "late":
            # The classifier is affine, so the mean of its per-token logits is the classifier
            # of the mean of its per-token inputs: hand those to the runner's MEAN pooling.
            return F.gelu(self.dense(hidden))
        return hidden

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled states (late: pooled GELU(dense) outputs) -> [N, num_labels]."""
        if self.pooling == "late":
            return self.classifier(pooled)
        return self.classifier(F.gelu(self.dense(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_eurobert_weights(self, weights, ())


# ---- jina-embeddings-v5-text-nano: EuroBERT with one task's LoRA adapter merged ------------

JINA_TASKS = ("retrieval", "text-matching", "classification", "clustering")


def jina_task(cfg: Any) -> str:
    """The adapter to merge: config field `jina_task` (hf_overrides), retrieval by default."""
    task = getattr(cfg, "jina_task", None) or "retrieval"
    allowed = tuple(getattr(cfg, "task_names", None) or JINA_TASKS)
    if task not in allowed:
        raise ValueError(f"jina_task must be one of {', '.join(allowed)} (got {task!r})")
    return task


def lora_deltas(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) as
    {checkpoint weight name: scale * B @ A} in float32."""
    cfg_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"jina-embeddings-v5 needs the task adapter {path} "
                                    "(pick the task with hf_overrides {\"jina_task\": ...})")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or \
            cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{cfg_path}: only plain LoRA adapters (one rank and alpha, no DoRA) "
                         "can be merged")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        base, _, kind = key.removeprefix("base_model.model.").partition(".lora_")
        kind = kind.removesuffix(".weight")
        if kind not in ("A", "B", "embedding_A", "embedding_B"):
            raise ValueError(f"{weights_path}: {key!r} is not a LoRA A or B tensor")
        parts.setdefault(encoder_name(base.removeprefix("model.")) + ".weight",
                         {})[kind[-1]] = tensor.float()
    deltas = {}
    for name, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights_path}: {name} lacks its LoRA A or B tensor")
        delta = ab["B"] @ ab["A"]  # an embedding's A is [r, vocab]: its delta is transposed
        deltas[name] = scale * (delta.T if name.endswith("embed_tokens.weight") else delta)
    return deltas


class JinaEmbeddingsV5Model(EuroBertModel):
    """jina-embeddings-v5-text-nano: a EuroBERT encoder, last-token pooled, with the task's
    LoRA adapter (adapters/<task>/ beside the weights) merged into the weights at load time.
    The family's Qwen3-backbone member (-small, is_decoder true) is not this class."""

    default_pooling_type = "LAST"

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        if getattr(hf_config, "is_decoder", False) or \
                getattr(hf_config, "model_type", "eurobert") != "eurobert":
            raise ValueError("JinaEmbeddingsV5Model: only the EuroBERT-encoder variant "
                             "(jina-embeddings-v5-text-nano: model_type eurobert, is_decoder "
                             "false) is supported")
        task = jina_task(hf_config)
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        self.task = task

    def load_extra_files(self, folder: Path) -> set[str]:
        """Adds the task adapter's deltas to the loaded weights; fills no new parameter."""
        params = dict(self.named_parameters())
        for name, delta in lora_deltas(folder / "adapters" / self.task).items():
            target, shard = packed_target(name, self.packed_modules_mapping)
            param = params.get(target)
            if param is None:
                raise ValueError(f"the {self.task} adapter changes {name!r}, which "
                                 f"{type(self).__name__} does not have")
            # the delta through the parameter's own loader (its shard, this rank's rows) into
            # zeros, then added in float32
            full = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            loader = getattr(param, "weight_loader", default_weight_loader)
            args = (delta.to(param.device),) if shard is None else (delta.to(param.device),
                                                                    shard)
            loader(full, *args)
            with torch.no_grad():
                param.copy_(param.float() + full)
        return set()
