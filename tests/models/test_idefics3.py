"""shoal's Idefics3ForConditionalGeneration against transformers' on a tiny random checkpoint
(SigLIP tower of 2 layers on 32 x 32 tiles of 8 x 8 patches, pixel shuffle by 2, a 2-layer
Llama), standalone (no engine): the checkpoint's names fill every parameter; the image
features of shoal's processor output equal transformers' get_image_features; padded pixel
masks take the same position buckets and key mask; and a prompt of text and two images
gives transformers' final hidden states and logits, at once and in two prefill chunks over
the paged KV cache (the torch attention backend), the chunk boundary inside an image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Idefics3Config
from transformers import Idefics3ForConditionalGeneration as HFIdefics3
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings
from vl_checkpoints import IDEFICS3_TILE, write_tiny_idefics3
from vl_checkpoints import noise_image as image

from shoal.attention.metadata import build_attention_metadata
from shoal.core.kv_cache_spec import group_layers
from shoal.loader.build import check_all_loaded
from shoal.models.idefics3 import Idefics3ForConditionalGeneration
from shoal.models.vision.siglip import SiglipVisionEmbeddings
from shoal.multimodal.processors.idefics3 import Idefics3Processor
from shoal.worker.kv_cache_tensors import allocate_kv_caches, layer_specs

TILE = IDEFICS3_TILE
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, HFIdefics3, Idefics3ForConditionalGeneration]:
    """(checkpoint folder, transformers' model, shoal's model loaded from the saved file)."""
    path = tmp_path_factory.mktemp("idefics3")
    hf = write_tiny_idefics3(path)
    ours = Idefics3ForConditionalGeneration(hf.config, torch.float32, use_triton_ops=False)
    loaded = ours.load_weights(load_file(str(path / "model.safetensors")).items())
    check_all_loaded(ours, loaded, "Idefics3ForConditionalGeneration")
    return path, hf, ours.eval()


def processed(path: Path, config: Idefics3Config, text: str, images: list):
    proc = Idefics3Processor(path, config, AutoTokenizer.from_pretrained(str(path)))
    return proc.process(proc.tokenizer.encode(text, add_special_tokens=False), images)


def stacked(features: list, key: str) -> torch.Tensor:
    """transformers' batch of one prompt: the features' tiles one after another."""
    return torch.cat([torch.tensor(f.arrays()[key]) for f in features])[None]


def test_checkpoint_names_fill_every_parameter(tiny) -> None:
    _, hf, ours = tiny
    names = set(hf.state_dict())
    assert {"model.connector.modality_projection.proj.weight", "lm_head.weight",
            "model.vision_model.encoder.layers.1.self_attn.q_proj.bias"} <= names
    check_all_loaded(ours, ours.load_weights(hf.state_dict().items()), "Idefics3")


@torch.inference_mode()
def test_image_features_match_transformers(tiny) -> None:
    path, hf, ours = tiny
    _, features = processed(path, hf.config, "w1 <image> w2", [image(50, 40, seed=0)])
    (got,) = ours.embed_multimodal(features)
    ref = hf.get_image_features(stacked(features, "pixel_values"),
                                stacked(features, "pixel_attention_mask")).pooler_output[0]
    assert got.shape == (features[0].num_embeds, 64) == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_padded_tiles_match_transformers(tiny) -> None:
    """Tiles whose real pixels cover part of the tile (a mask transformers' processor makes
    when it pads tiles of several sizes): fewer real patches spread over the trained
    positions, padding patches left out of attention; a patch is real when any pixel is."""
    _, hf, ours = tiny
    torch.manual_seed(1)
    pixels = torch.randn(3, 3, TILE, TILE)
    mask = torch.zeros(3, TILE, TILE, dtype=torch.long)
    mask[0] = 1
    mask[1, :24, :16] = 1  # 3 x 2 real patches
    mask[2, :20, :] = 1  # the third patch row real through 4 of its pixel rows
    got = ours.encode_tiles(pixels, mask.bool())
    ref = hf.get_image_features(pixels[None], mask[None]).pooler_output[0]
    torch.testing.assert_close(got.reshape(-1, 64), ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_position_buckets_match_transformers_on_27_positions_a_side() -> None:
    """SmolVLM-2.2B's grid (378 / 14 = 27 a side: 1/27 is inexact in float32): every count
    of real rows and columns takes transformers' buckets. Read off a position embedding that
    holds its own index, with the patch conv zeroed."""
    cfg = Idefics3VisionConfig(hidden_size=2, image_size=378, patch_size=14)
    hf = Idefics3VisionEmbeddings(cfg)
    hf.patch_embedding.weight.data.zero_()
    hf.patch_embedding.bias.data.zero_()
    hf.position_embedding.weight.data[:, 0] = torch.arange(27 * 27)
    mask = torch.zeros(27, 27, 27, dtype=torch.bool)
    for i in range(27):  # tile i: i + 1 real rows, 27 - i real columns
        mask[i, :i + 1, :27 - i] = True
    ref = hf(torch.zeros(27, 3, 378, 378), mask)[..., 0].long()
    ours = SiglipVisionEmbeddings(cfg, torch.float32)
    assert torch.equal(ours.position_ids(mask), ref)


def prefill(ours: Idefics3ForConditionalGeneration, ids: torch.Tensor, mm: torch.Tensor,
            chunks: list[int]) -> torch.Tensor:
    """The prompt through the paged cache in chunks of the given lengths, each chunk taking
    the image rows of its own <image> positions; final hidden states of every position."""
    layers = ours.attention_layers()
    specs = layer_specs(layers, torch.float32)
    n_blocks = -(-len(ids) // BLOCK)
    allocate_kv_caches(layers, specs, group_layers(specs), (n_blocks + 1) * BLOCK,
                       torch.float32, torch.device("cpu"), BLOCK)
    is_mm = ids == ours.image_token_id
    outs, start, row = [], 0, 0
    for n in chunks:
        sl = slice(start, start + n)
        md = build_attention_metadata(
            query_lens=[n], context_lens=[start], block_tables=[list(range(n_blocks))],
            block_size=BLOCK, num_decodes=0, sliding_window=None,
            device=torch.device("cpu"), null_block=n_blocks)
        k = int(is_mm[sl].sum())
        embeds = ours.embed_input_ids(ids[sl], mm[row:row + k], is_mm[sl])
        outs.append(ours(ids[sl], torch.arange(start, start + n), md, inputs_embeds=embeds))
        start, row = start + n, row + k
    return torch.cat(outs)


@torch.inference_mode()
def test_prompt_with_two_images_matches_transformers(tiny) -> None:
    path, hf, ours = tiny
    images = [image(50, 40, seed=2), image(10, 60, seed=3)]  # 2 x 2 tiles, then 1 x 2
    ids, features = processed(path, hf.config, "w7 w8 <image> w9 <image> w10 w11", images)
    ids_t = torch.tensor(ids)
    ref = hf(input_ids=ids_t[None], pixel_values=stacked(features, "pixel_values"),
             pixel_attention_mask=stacked(features, "pixel_attention_mask"),
             output_hidden_states=True)
    ref_hidden, ref_logits = ref.hidden_states[-1][0], ref.logits[0]
    mm = torch.cat(ours.embed_multimodal(features))
    assert mm.shape[0] == sum(f.num_embeds for f in features) == int((ids_t == ours.image_token_id).sum())
    cut = features[0].offset + 10  # inside the first image's span
    for chunks in ([len(ids)], [cut, len(ids) - cut]):
        hidden = prefill(ours, ids_t, mm, chunks)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.compute_logits(hidden), ref_logits, rtol=1e-4,
                                   atol=1e-4)
