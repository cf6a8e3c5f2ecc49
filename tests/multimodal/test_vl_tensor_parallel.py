"""Images under tensor parallelism on the CPU (two gloo ranks): every rank gets the images
with the new request, runs the (replicated) vision tower for the step's encoder inputs and
places the outputs in its slice of the decoder; tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch
from vl_checkpoints import hf_greedy, image, write_tiny_qwen2_5_vl

pytestmark = pytest.mark.slow

PROMPT = "w1 w2 <|vision_start|><|image_pad|><|vision_end|> w3 w4"


def test_two_ranks_match_transformers(tmp_path) -> None:
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    from shoal import LLM, SamplingParams

    folder = write_tiny_qwen2_5_vl(tmp_path / "model")
    images = [image(4, 90, 60), image(5, 60, 90)]
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s to build
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, tensor_parallel_size=2,
              max_num_batched_tokens=16, num_gpu_blocks_override=512)
    try:
        driver = llm.llm_engine.core.runner.driver  # rank 0, in this process
        assert driver.model.attention_layers()[0].num_heads == 2  # really split
        outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}}
                             for im in images],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    for out, im in zip(outs, images):
        ids = list(out.prompt_token_ids)
        mm = processor(images=[im], return_tensors="pt")
        kinds = (torch.tensor([ids]) == hf.config.image_token_id).int()
        want = hf_greedy(hf, ids, 6, pixel_values=mm["pixel_values"],
                         image_grid_thw=mm["image_grid_thw"], mm_token_type_ids=kinds)
        got = list(out.outputs[0].token_ids)
        # (transformers stops at EOS, which shoal's ignore_eos runs past)
        assert got[:len(want)] == want and (len(want) == 6 or want[-1] == 2)
