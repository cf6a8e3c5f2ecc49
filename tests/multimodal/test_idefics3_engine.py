"""The whole engine serving a tiny random Idefics3 (SigLIP tower of 2 layers on 32 x 32 tiles
of 8 x 8 patches, pixel shuffle by 2, a 2-layer Llama; the folder as tests/models/
test_idefics3.py writes it) against transformers' greedy decoding of the same expanded
prompt and pixel tensors: one image, two images, chunked prefill through the tile layout
(whose spans mix <image> positions with marker text), a repeated image encoded once, and a
prefix hit on the text before an image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers import Idefics3ForConditionalGeneration as HFIdefics3
from vl_checkpoints import IDEFICS3_TILE, record_placed, write_tiny_idefics3
from vl_checkpoints import noise_image as image

from shoal import LLM, SamplingParams
from shoal.multimodal.processors.idefics3 import Idefics3Processor

TILE = IDEFICS3_TILE
MAX_TOKENS = 8
BLOCK = 16  # the engine's default block size


class Oracle:
    """transformers' model (the one saved to the folder) and shoal's processor."""

    def __init__(self, folder: Path, model: HFIdefics3):
        self.model = model
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.proc = Idefics3Processor(folder, model.config, self.tok)

    def expand(self, text: str, images: list) -> tuple[list[int], list]:
        return self.proc.process(self.tok.encode(text, add_special_tokens=False), images)

    @torch.no_grad()
    def run(self, text: str, images: list) -> tuple[list[int], list[int], list[float]]:
        """(expanded prompt, greedy tokens, log-softmax of each chosen token)."""
        ids, features = self.expand(text, images)
        x = torch.tensor([ids])

        def stacked(key: str) -> torch.Tensor:  # one prompt's tiles, image after image
            return torch.cat([torch.tensor(f.arrays()[key]) for f in features])[None]

        out = self.model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
            pixel_values=stacked("pixel_values"),
            pixel_attention_mask=stacked("pixel_attention_mask"))
        tokens = out.sequences[0, len(ids):].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item()
               for lg, t in zip(out.logits, tokens)]
        return ids, tokens, lps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Oracle]:
    path = tmp_path_factory.mktemp("idefics3")
    hf = write_tiny_idefics3(path)
    return path, Oracle(path, hf)


def make_llm(folder: Path, **kw) -> LLM:
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s an engine
    args = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=256,
                enable_prefix_caching=True, num_gpu_blocks_override=512)
    return LLM(model=str(folder), **{**args, **kw})


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return make_llm(tiny[0])


def generate(llm: LLM, text: str, images: list):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    return llm.generate(prompt, params, use_tqdm=False)[0]


def check_against_hf(oracle: Oracle, out, text: str, images: list,
                     logprobs: bool = False) -> None:
    ids, tokens, lps = oracle.run(text, images)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens
    if logprobs:
        got = [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, lps, rtol=0, atol=1e-4)


def test_one_image_matches_transformers(tiny, llm) -> None:
    _, oracle = tiny
    text, images = "w1 w2 <image> w3", [image(50, 40, seed=0)]  # 2 x 2 tiles + global
    out = generate(llm, text, images)
    _, (feature,) = oracle.expand(text, images)
    assert feature.embed_mask is not None and feature.num_embeds == 5 * 4 < feature.length
    check_against_hf(oracle, out, text, images, logprobs=True)


def test_two_images_match_transformers(tiny, llm) -> None:
    _, oracle = tiny
    text = "w7 w8 <image> w9 <image> w10 w11"
    images = [image(50, 40, seed=2), image(10, 60, seed=3)]  # 2 x 2 tiles, then 1 x 2
    check_against_hf(oracle, generate(llm, text, images), text, images, logprobs=True)


def test_chunked_prefill_through_the_tile_layout(tiny, monkeypatch) -> None:
    """Steps of 8 tokens: each span (tile markers, newlines and <image> runs) is cut at many
    places, each step placing the encoder rows of the <image> positions it covers."""
    folder, oracle = tiny
    small = make_llm(folder, max_num_batched_tokens=8)
    placed = record_placed(monkeypatch, small)
    text = "w12 <image> w13 w14 <image> w15"
    images = [image(50, 40, seed=4), image(40, 64, seed=5)]
    out = generate(small, text, images)
    _, features = oracle.expand(text, images)
    assert sum(placed) == sum(f.num_embeds for f in features)
    assert len(placed) >= 6 and max(placed) <= 8
    check_against_hf(oracle, out, text, images, logprobs=True)


def test_repeated_image_is_encoded_once(tiny, llm) -> None:
    _, oracle = tiny
    enc = llm.llm_engine.core.scheduler.encoders
    mm = llm.llm_engine.core.runner.mm
    img = image(30, 60, seed=6)
    first, second = "w20 w21 <image> w22", "w30 w31 w32 <image> w33"
    before = (enc.num_encoded, enc.num_hits, mm.num_encoded)
    a = generate(llm, first, [img])
    b = generate(llm, second, [img])
    assert b.num_cached_tokens == 0
    assert (enc.num_encoded, enc.num_hits, mm.num_encoded) == (
        before[0] + 1, before[1] + 1, before[2] + 1)
    check_against_hf(oracle, a, first, [img])
    check_against_hf(oracle, b, second, [img])


def test_prefix_hit_on_the_text_before_an_image(tiny, llm) -> None:
    _, oracle = tiny
    text = " ".join(f"w{i}" for i in range(100, 140)) + " <image> w1"  # 40 words
    first, other = [image(50, 40, seed=7)], [image(50, 40, seed=8)]
    a = generate(llm, text, first)
    b = generate(llm, text, other)
    offset = oracle.expand(text, other)[1][0].offset
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 32 == (40 // BLOCK) * BLOCK  # the image's block not shared
    assert offset > 40  # the first tile marker at 40, its first <image> after it
    check_against_hf(oracle, a, text, first)
    check_against_hf(oracle, b, text, other)
    # the same prompt and image again: cached into the image's span, the rest of which
    # reads the encoder cache
    encoded = llm.llm_engine.core.scheduler.encoders.num_encoded
    c = generate(llm, text, first)
    end = oracle.expand(text, first)[1][0].end
    assert offset < c.num_cached_tokens < end
    assert llm.llm_engine.core.scheduler.encoders.num_encoded == encoded
    assert c.outputs[0].token_ids == a.outputs[0].token_ids
