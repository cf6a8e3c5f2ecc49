"""The offline pooling API of `LLM` (vLLM's names and output classes): encode, embed,
classify, score. Every prompt is validated before any of them runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shoal.inputs import prompt_list
from shoal.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from shoal.pooling.scoring import cosine, score_pairs
from shoal.pooling_params import PoolingParams


class PoolingMixin:
    """Mixed into LLM: needs `llm_engine` and `_run`."""

    llm_engine: Any

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams]
               | None = None, *, use_tqdm: bool = True, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Raw pooled results (`.outputs.data`, a torch tensor). pooling_task: embed,
        token_embed, classify or score (default: that of pooling_params, else embed).
        truncate_prompt_tokens: keep that many tokens of each input (-1: max_model_len), for
        every pooling_params that does not say otherwise."""
        prompts = prompt_list(prompts)
        params = _params_list(pooling_params, len(prompts), pooling_task,
                              truncate_prompt_tokens)
        return self._run_pooling([(p, sp, None) for p, sp in zip(prompts, params)], use_tqdm)

    def embed(self, prompts: Any, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed",
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()),
                                       o.prompt_token_ids, o.finished) for o in outs]

    def classify(self, prompts: Any, *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None,
                 ) -> list[ClassificationRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify",
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id,
                                            ClassificationOutput(o.outputs.data.tolist()),
                                            o.prompt_token_ids, o.finished) for o in outs]

    def score(self, data_1: Any, data_2: Any, /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: a cross-encoder's sigmoid output, or the
        cosine similarity of two embeddings. data_1 is one text or as many as data_2."""
        pairs = score_pairs(data_1, data_2)
        info = self.llm_engine.core.limits.pooling
        if info is None or "score" not in info.tasks:
            raise ValueError("score needs an embedding model or a cross-encoder (a "
                             "classification model with one label)")
        if info.is_cross_encoder:
            params = pooling_params or PoolingParams(task="score")
            if params.task != "score":
                raise ValueError("pooling_params.task must be 'score' for score()")
            inputs = self.llm_engine.inputs
            encoded = [inputs.encode_pair(a, b) for a, b in pairs]
            outs = self._run_pooling([({"prompt_token_ids": ids}, params, tt)
                                      for ids, tt in encoded], use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                         o.prompt_token_ids, o.finished) for o in outs]
        params = pooling_params or PoolingParams(task="embed")
        flat = [t for pair in pairs for t in pair]
        embs = self._run_pooling([(t, params, None) for t in flat], use_tqdm)
        return [ScoringRequestOutput(
            f"score-{a.request_id}-{b.request_id}",
            ScoringOutput(cosine(a.outputs.data.numpy(), b.outputs.data.numpy())),
            a.prompt_token_ids + b.prompt_token_ids, True)
            for a, b in zip(embs[::2], embs[1::2])]

    def _run_pooling(self, reqs: list[tuple[Any, PoolingParams, list[int] | None]],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        import torch

        eng = self.llm_engine
        if eng.core.limits.pooling is None:
            raise ValueError("this model generates text: embed, classify and score need a "
                             "pooling model (runner='pooling', or an encoder such as "
                             "all-MiniLM-L6-v2)")
        processed = [eng.inputs.process_pooling_request(eng.next_request_id(), p, sp,
                                                        token_type_ids=tt)
                     for p, sp, tt in reqs]
        for r in processed:
            eng.submit(r)
        outs = self._run([r.request_id for r in processed], use_tqdm)
        for o in outs:
            if o.outputs is None:  # not failed (that raised in _run), yet without a result
                raise RuntimeError(f"pooling request {o.request_id} ended without a result")
            o.outputs.data = torch.from_numpy(o.outputs.data.copy())
        return outs


def _params_list(params: PoolingParams | Sequence[PoolingParams] | None, n: int,
                 task: str | None, truncate: int | None = None) -> list[PoolingParams]:
    if params is None:
        return [PoolingParams(task=task or "embed", truncate_prompt_tokens=truncate)] * n
    plist = [params] * n if isinstance(params, PoolingParams) else list(params)
    if len(plist) != n:
        raise ValueError(f"pooling_params needs one entry per prompt ({n}), got {len(plist)}")
    for p in plist:
        if not isinstance(p, PoolingParams):
            raise ValueError("pooling_params must be PoolingParams")
    # The call names the task (as vLLM's embed/classify do); the params keep the rest.
    plist = [dataclasses.replace(p, task=task) if task and p.task != task else p
             for p in plist]
    return [dataclasses.replace(p, truncate_prompt_tokens=truncate)
            if truncate is not None and p.truncate_prompt_tokens is None else p for p in plist]
