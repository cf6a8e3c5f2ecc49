"""Qwen3-VL (dense) against transformers on a tiny random checkpoint: the vision tower's
main and deepstack features, M-RoPE positions, and greedy tokens through the offline engine
with an image in the prompt (whole and chunked prefill)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vl_checkpoints import hf_greedy, image, write_tiny_qwen3_vl

from shoal.models.qwen3_vl import Qwen3VLForConditionalGeneration
from shoal.multimodal.inputs import make_feature

ARCH = "Qwen3VLForConditionalGeneration"
PROMPT = "w1 w2 <|vision_start|><|image_pad|><|vision_end|> w3"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Any]:
    from transformers import Qwen3VLForConditionalGeneration as HF

    path = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))
    hf = HF.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def ours(tiny) -> Qwen3VLForConditionalGeneration:
    from safetensors.torch import load_file

    path, hf = tiny
    text = _text_config(hf.config)
    model = Qwen3VLForConditionalGeneration(text, torch.float32, use_triton_ops=False).eval()
    state = load_file(str(path / "model.safetensors"))
    loaded = model.load_weights(state.items())
    assert loaded == set(dict(model.named_parameters()))
    return model


def _text_config(config: Any) -> Any:
    import copy

    text = copy.deepcopy(config.text_config)
    text.architectures = [ARCH]
    text.multimodal_config = config
    text.image_token_id = config.image_token_id
    return text


def _pixels(path: Path, images: list[Any]) -> dict[str, np.ndarray]:
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    return dict(proc(images=images, return_tensors="np"))


def _features(out: dict[str, np.ndarray], offsets: list[int] | None = None) -> list[Any]:
    feats, row = [], 0
    for i, grid in enumerate(out["image_grid_thw"]):
        n = int(np.prod(grid))
        arrays = {"pixel_values": out["pixel_values"][row:row + n], "image_grid_thw": grid}
        at = offsets[i] if offsets else 0
        feats.append(make_feature("qwen_vl", "image", at, n // 4, arrays))
        row += n
    return feats


@pytest.mark.parametrize("sizes", [[(96, 64)], [(96, 64), (128, 128)]], ids=["one", "two"])
def test_tower_matches_transformers(tiny, ours, sizes) -> None:
    path, hf = tiny
    out = _pixels(path, [image(i, w, h) for i, (w, h) in enumerate(sizes)])
    with torch.no_grad():
        got = ours.embed_multimodal(_features(out))
        ref = hf.model.get_image_features(torch.from_numpy(out["pixel_values"]),
                                          torch.from_numpy(out["image_grid_thw"]))
    assert len(got) == len(sizes)
    for i, g in enumerate(got):
        want = torch.cat([ref.pooler_output[i], *(d[i] for d in ref.deepstack_features)], -1)
        assert g.shape == want.shape == (want.shape[0], 64 * 3)
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_mrope_positions_match_transformers(tiny, ours) -> None:
    path, hf = tiny
    out = _pixels(path, [image(0, 96, 64), image(1, 128, 128)])
    pad, vs, ve = (hf.config.image_token_id, hf.config.vision_start_token_id,
                   hf.config.vision_end_token_id)
    counts = [int(np.prod(g)) // 4 for g in out["image_grid_thw"]]
    ids = [20, 21, vs, *[pad] * counts[0], ve, 22, vs, *[pad] * counts[1], ve, 23, 24]
    feats = _features(out, [3, 3 + counts[0] + 3])
    pos, delta = ours.get_mrope_positions(ids, feats)
    t = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(
        t, (t == pad).int(), image_grid_thw=torch.from_numpy(out["image_grid_thw"]))
    assert torch.equal(pos, ref[:, 0])
    assert delta == int(ref_delta)


def _expanded(path: Path, hf: Any, img: Any) -> tuple[list[int], dict[str, torch.Tensor]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    out = _pixels(path, [img])
    pad = hf.config.image_token_id
    n = int(np.prod(out["image_grid_thw"][0])) // 4
    ids: list[int] = []
    for t in tok(PROMPT, add_special_tokens=False)["input_ids"]:
        ids.extend([pad] * n if t == pad else [t])
    mm = {"pixel_values": torch.from_numpy(out["pixel_values"]),
          "image_grid_thw": torch.from_numpy(out["image_grid_thw"]),
          "mm_token_type_ids": (torch.tensor([ids]) == pad).int()}
    return ids, mm


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_engine_greedy_matches_transformers(tiny, chunk) -> None:
    from shoal import LLM, SamplingParams

    path, hf = tiny
    img = image(3, 96, 64)
    ids, mm = _expanded(path, hf, img)
    want = hf_greedy(hf, ids, 6, **mm)
    want_logprobs = _hf_logprobs(hf, ids, want, mm)
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(model=str(path), dtype="float32", max_model_len=512,
              num_gpu_blocks_override=512, **extra)  # CPU default: ~500k blocks, ~1.3 s
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": img}}], params,
                       use_tqdm=False)
    got = out[0].outputs[0]
    assert got.token_ids == want
    # logprobs too: greedy tokens of a tiny random model barely notice a deepstack or
    # rotary-layout mistake, the log-probabilities do
    for step, tok in enumerate(want):
        assert got.logprobs[step][tok].logprob == pytest.approx(want_logprobs[step], abs=1e-4)


def _hf_logprobs(hf: Any, ids: list[int], tokens: list[int],
                 mm: dict[str, torch.Tensor]) -> list[float]:
    """transformers' log-probability of each greedy token, from one forward over the
    prompt and the tokens before it."""
    full = torch.tensor([ids + tokens[:-1]])
    types = torch.zeros_like(full, dtype=torch.int)
    types[:, :len(ids)] = mm["mm_token_type_ids"]
    with torch.no_grad():
        logits = hf(input_ids=full, pixel_values=mm["pixel_values"],
                    image_grid_thw=mm["image_grid_thw"], mm_token_type_ids=types).logits[0]
    logprobs = torch.log_softmax(logits[len(ids) - 1:].float(), -1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def test_deepstack_kept_for_the_next_forward_only(ours) -> None:
    """embed_input_ids keeps the deepstack part of the rows for the forward that follows;
    a step without image rows keeps none."""
    ids = torch.tensor([20, 5, 5, 21])
    mask = ids == 5
    rows = torch.randn(2, 64 * 3)
    embeds = ours.embed_input_ids(ids, rows, mask)
    torch.testing.assert_close(embeds[mask], rows[:, :64])
    features, kept = ours.model.pending
    assert features.shape == (2, 2, 64) and torch.equal(kept, mask)
    torch.testing.assert_close(features[1], rows[:, 128:])
    ours.embed_input_ids(ids)
    assert ours.model.pending is None
