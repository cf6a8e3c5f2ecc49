"""A lone prompt with an adapter runs through the padded prefill graph (replays emulated on
the CPU, worker/eager_graphs.py; the Triton attention and LoRA kernels under
TRITON_INTERPRET=1) and gives the eager engine's tokens: the graph's padding rows follow the
prompt's tokens, so the LoRA slot table's flat order holds."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from peft_adapters import write_adapter  # noqa: E402
from worker.test_decode_graphs_cpu import _graphs  # noqa: E402

import shoal.lora.slots as lora_slots  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.lora.request import LoRARequest  # noqa: E402
from shoal.worker.graph_table import StepShape  # noqa: E402
from shoal.worker.model_graphs import step_shapes  # noqa: E402

PROMPT = {"prompt_token_ids": [5, 17, 300, 42, 7, 99, 256, 3, 11, 400, 23]}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _llm(path) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
               num_gpu_blocks_override=128, max_model_len=96, max_num_seqs=2,
               attention_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=8)


def test_a_lone_prompt_with_an_adapter_replays_the_prefill_graph(tiny_llama_dir, tmp_path,
                                                                  monkeypatch) -> None:
    # the GPU's LoRA path (the Triton kernels, a slot table for padded rows) on the CPU
    real_step = lora_slots.LoRAStep
    monkeypatch.setattr(lora_slots, "LoRAStep",
                        lambda max_tokens, device, use_triton: real_step(max_tokens, device,
                                                                         use_triton=True))
    adapter = write_adapter(tiny_llama_dir, tmp_path / "a", seed=1, r=8)
    lora = LoRARequest("a", 1, str(adapter))
    eager = _llm(tiny_llama_dir)
    want = eager.generate(PROMPT, GREEDY, lora_request=lora, use_tqdm=False)[0]
    base = eager.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert want.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter matters
    eager.shutdown()

    llm = _llm(tiny_llama_dir)
    shapes = [s for s in step_shapes(2, 32) if s.rows == 1 and s.q > 1] + [StepShape(1, 1)]
    graphs = _graphs(llm.llm_engine.core.runner, shapes, 96 // 4)
    got = llm.generate(PROMPT, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # the 11-token prompt replayed the 16-token prefill graph, the decodes the decode graph
    assert (StepShape(1, 16), 1) in graphs.runs and (StepShape(1, 1), 1) in graphs.runs
