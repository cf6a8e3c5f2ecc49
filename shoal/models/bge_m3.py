"""BGE-M3's three outputs over one XLM-RoBERTa forward (select it as vLLM does:
hf_overrides='{"architectures": ["BgeM3EmbeddingModel"]}').

- dense (task "embed"): the [CLS] state, normalized (the model's sentence-transformers files);
- multi-vector / ColBERT (task "token_embed"): colbert_linear over every token but [CLS],
  normalized per token;
- sparse lexical weights (task "token_classify"): relu(sparse_linear) per token; a client
  keeps, per token id, the largest weight of the non-special tokens (FlagEmbedding's dict).

The two heads ship beside the safetensors as colbert_linear.pt and sparse_linear.pt (plain
state dicts), read with torch.load(weights_only=True): no pickle is executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.models.interface import EMBED_TASKS
from shoal.models.roberta import XLMRobertaModel

HEAD_FILES = {"colbert_linear": "colbert_linear.pt", "sparse_linear": "sparse_linear.pt"}


class BgeM3EmbeddingModel(XLMRobertaModel):
    default_pooling_type = "CLS"
    pooling_tasks = (*EMBED_TASKS, "token_classify")
    has_token_heads = True  # token_embed: ColBERT vectors; token_classify: sparse weights

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        h = hf_config.hidden_size
        self.colbert_linear = nn.Linear(h, getattr(hf_config, "colbert_dim", None) or h,
                                        dtype=dtype)
        self.sparse_linear = nn.Linear(h, 1, dtype=dtype)

    def load_extra_files(self, folder: Path) -> set[str]:
        """The two heads' .pt files; returns the parameter names they filled."""
        loaded: set[str] = set()
        for module_name, file in HEAD_FILES.items():
            path = folder / file
            if not path.is_file():
                raise FileNotFoundError(f"BGE-M3 needs {file} in {folder}")
            state = torch.load(path, map_location="cpu", weights_only=True)
            module = getattr(self, module_name)
            for key, tensor in state.items():
                param = getattr(module, key.rsplit(".", 1)[-1])
                if param.shape != tensor.shape:
                    raise ValueError(f"{file}: {key} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
                loaded.add(f"{module_name}.{key.rsplit('.', 1)[-1]}")
        return loaded

    def token_output(self, task: str, hidden: torch.Tensor) -> torch.Tensor:
        """One sequence's [L, hidden] states -> its per-token result (float32)."""
        if task == "token_embed":
            return F.normalize(self.colbert_linear(hidden[1:]).float(), dim=-1)
        if task == "token_classify":
            return torch.relu(self.sparse_linear(hidden).float()).squeeze(-1)
        raise ValueError(f"BGE-M3 has no per-token output for task {task!r}")
