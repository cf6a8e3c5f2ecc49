"""shoal's LlavaForConditionalGeneration against transformers' on tiny random checkpoints (a
2-layer CLIP or SigLIP tower on 32 x 32 images of 8 x 8 patches, the 2-layer GELU projector,
a 2-layer Llama or Qwen2 decoder): the saved and the in-memory names fill every parameter;
image features equal transformers' get_image_features for each feature layer and select
strategy; and the whole engine's greedy tokens and logprobs equal transformers' for prompts
with one and two images, in one prefill and in steps of 8 tokens. The architecture is
registered only for this module's tests (monkeypatch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import randomize_weights
from safetensors.torch import load_file
from transformers import LlavaConfig
from transformers import LlavaForConditionalGeneration as HFLlava
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from vl_checkpoints import image, record_placed, word_tokenizer

import shoal.models.registry
import shoal.multimodal.processors
from shoal import LLM, SamplingParams
from shoal.loader.build import check_all_loaded
from shoal.models.llava import LlavaForConditionalGeneration
from shoal.multimodal.processors.llava import LlavaProcessor

ARCH = "LlavaForConditionalGeneration"
SIZE, PATCH = 32, 8
MAX_TOKENS = 6
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "patch_size": PATCH, "image_size": SIZE}


def tiny_config(vocab: int, image_id: int, tower: str = "clip_vision_model",
                text: str = "llama", **kw) -> LlavaConfig:
    return LlavaConfig(
        vision_config={"model_type": tower, **VISION},
        text_config={"model_type": text, "vocab_size": vocab, "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2},
        image_token_id=image_id, tie_word_embeddings=False, architectures=[ARCH], **kw)


def write_folder(path: Path, tower: str = "clip_vision_model", text: str = "llama",
                 **kw) -> tuple[Path, HFLlava]:
    tok, vocab = word_tokenizer(["<image>"])
    torch.manual_seed(0)
    hf = HFLlava(tiny_config(vocab, tok.convert_tokens_to_ids("<image>"), tower, text,
                             **kw)).eval()
    randomize_weights(hf)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": SIZE},
                          crop_size={"height": SIZE, "width": SIZE}).save_pretrained(path)
    return path, hf


def ours_from(hf: HFLlava, weights) -> LlavaForConditionalGeneration:
    ours = LlavaForConditionalGeneration(hf.config, torch.float32, use_triton_ops=False)
    check_all_loaded(ours, ours.load_weights(weights), ARCH)
    return ours.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, HFLlava]:
    return write_folder(tmp_path_factory.mktemp("llava"))


def stacked(features: list) -> torch.Tensor:
    """transformers' pixel_values of one prompt: its images one after another."""
    return torch.cat([torch.tensor(f.arrays()["pixel_values"]) for f in features])


def processor(path: Path, config: LlavaConfig) -> LlavaProcessor:
    from transformers import AutoTokenizer

    return LlavaProcessor(path, config, AutoTokenizer.from_pretrained(str(path)))


def test_saved_and_loaded_names_fill_every_parameter(tiny) -> None:
    path, hf = tiny
    saved = load_file(str(path / "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in saved  # the names saved to disk
    assert "model.language_model.embed_tokens.weight" in hf.state_dict()  # the loaded ones
    ours = ours_from(hf, saved.items())
    # layers past vision_feature_layer (-2 of 2: the output of layer 0) are not built
    assert len(ours.model.vision_tower.encoder.layers) == 1
    ours_from(hf, hf.state_dict().items())


@pytest.mark.parametrize("tower, kw", [
    ("clip_vision_model", {}),
    ("clip_vision_model", {"vision_feature_select_strategy": "full",
                           "vision_feature_layer": -1}),
    ("clip_vision_model", {"vision_feature_layer": [0, -1]}),
    ("siglip_vision_model", {"vision_feature_select_strategy": "full",
                             "vision_feature_layer": -1, "projector_hidden_act": "gelu"}),
    ("siglip_vision_model", {}),
])
@torch.inference_mode()
def test_image_features_match_transformers(tiny, tower, kw) -> None:
    path, saved = tiny
    torch.manual_seed(1)
    hf = HFLlava(tiny_config(saved.config.text_config.vocab_size,
                             saved.config.image_token_id, tower, **kw)).eval()
    randomize_weights(hf)
    ours = ours_from(hf, hf.state_dict().items())
    images = [image(3, 40, 50), image(4, 20, 30)]
    ids, features = processor(path, hf.config).process([5, 3, 6, 3], images)
    got = ours.embed_multimodal(features)
    pixels = stacked(features)
    ref = hf.get_image_features(
        pixels, vision_feature_layer=hf.config.vision_feature_layer,
        vision_feature_select_strategy=hf.config.vision_feature_select_strategy).pooler_output
    patches = (SIZE // PATCH) ** 2
    extra = (tower == "clip_vision_model") - (hf.config.vision_feature_select_strategy
                                              == "default")
    assert [f.num_embeds for f in features] == [patches + extra] * 2
    assert len(ids) == 2 + 2 * (patches + extra)
    with pytest.raises(ValueError, match="placeholders for 1 image"):
        processor(path, hf.config).process([5, 3, 6, 3], images[:1])
    for g, r in zip(got, ref):
        assert g.shape == r.shape == (patches + extra, 64)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


# ---- the whole engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """LLaVA is in shoal's model and processor tables (checked here)."""
    assert ARCH in shoal.models.registry._MODELS
    assert ARCH in shoal.multimodal.processors._PROCESSORS
    yield


def make_llm(folder: Path, **kw) -> LLM:
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s an engine
    return LLM(model=str(folder), dtype="float32", max_model_len=512,
               num_gpu_blocks_override=512, **kw)


@pytest.fixture(scope="module")
def llm(tiny, registered) -> LLM:
    return make_llm(tiny[0])


@torch.no_grad()
def hf_run(path: Path, hf: HFLlava, text: str, images: list
           ) -> tuple[list[int], list[int], list[float]]:
    """(expanded prompt, transformers' greedy tokens, the log-softmax of each)."""
    proc = processor(path, hf.config)
    ids, features = proc.process(proc.tokenizer.encode(text, add_special_tokens=False), images)
    x = torch.tensor([ids])
    pixels = stacked(features)
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels,
                      max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return ids, tokens, lps


def check(llm: LLM, path: Path, hf: HFLlava, text: str, images: list) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    ids, tokens, lps = hf_run(path, hf, text, images)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens
    got = [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, tokens)]
    np.testing.assert_allclose(got, lps, rtol=0, atol=1e-4)
    return got


def test_one_image_matches_transformers(tiny, llm) -> None:
    assert isinstance(llm.llm_engine.core.runner.model, LlavaForConditionalGeneration)
    a = check(llm, *tiny, "w1 w2 <image> w3", [image(0, 40, 50)])
    b = check(llm, *tiny, "w1 w2 <image> w3", [image(9, 40, 50)])
    assert a != b  # the image reaches the decoder


def test_two_images_match_transformers(tiny, llm) -> None:
    check(llm, *tiny, "w7 w8 <image> w9 <image> w10 w11", [image(1, 64, 32), image(2, 30, 30)])


def test_chunked_prefill_through_images(tiny, registered, monkeypatch) -> None:
    """Steps of 8 tokens: each image's 16 positions span several steps."""
    small = make_llm(tiny[0], max_num_batched_tokens=8)
    placed = record_placed(monkeypatch, small)
    check(small, *tiny, "w12 <image> w13 w14 <image> w15", [image(4, 50, 40), image(5, 32, 32)])
    assert sum(placed) == 2 * 16 and len(placed) >= 4 and max(placed) <= 8


def test_siglip_tower_and_qwen2_text_through_the_engine(tmp_path, registered) -> None:
    """The SigLIP variant (no CLS; "full" keeps every patch) over a Qwen2 decoder (q/k/v
    bias)."""
    path, hf = write_folder(tmp_path, "siglip_vision_model", "qwen2",
                            vision_feature_select_strategy="full", vision_feature_layer=-1)
    check(make_llm(path), path, hf, "w3 <image> w4 w5", [image(6, 40, 40)])
