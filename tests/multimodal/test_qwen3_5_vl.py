"""Qwen3.5 with images and video (Qwen3_5ForConditionalGeneration and its MoE form: the
Gated DeltaNet + gated attention decoder under Qwen3-VL's vision front end, without
deepstack) against transformers 5.25 on tiny random checkpoints: the tower and the M-RoPE
positions; the engine's greedy tokens and logprobs against transformers' generate on the same
processor output for text alone, one image, two images and a video; chunked prefill through
an image; a prefix hit on the text before an image (attention blocks and the linear layers'
state restored); EVS at rate 0.5 on a video (hand-made oracle, as test_qwen3_vl_evs.py);
the MoE form; and the language-model-only fallback (every modality's limit 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from oracle import randomize_weights
from test_evs import reference_mask
from test_qwen3_vl_evs import evs_video
from test_qwen3_vl_video import IMG, VID, Oracle
from test_video import noise_frames
from vl_checkpoints import QWEN_SPECIALS, image, record_placed

from shoal import LLM, SamplingParams
from shoal.multimodal.video import Video

STEPS = 6
# 3 Gated DeltaNet layers, then a full-attention one whose M-RoPE rotates half of each head:
# 4 frequencies, interleaved t, h, w, t
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rms_norm_eps=1e-5, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                                 mrope_interleaved=True),
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


def byte_tokenizer() -> tuple[Any, int]:
    """A byte-level BPE tokenizer without merges (one token a byte) and the Qwen specials:
    transformers loads any qwen3_5 folder's tokenizer as Qwen3_5Tokenizer (its own BPE
    pre-tokenizer over the file's vocab and merges), which keeps this one as it is."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    words = ["<|endoftext|>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    backend = Tokenizer(BPE({w: i for i, w in enumerate(words)}, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    end = "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=end, pad_token=end,
                                  unk_token=end)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    return tok, len(words) + len(QWEN_SPECIALS)


def write_tiny_qwen3_5_vl(path: Path, moe: bool = False, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 (or Qwen3.5-MoE) vision-language folder: Qwen3-VL's tower
    shape (patch 16, 2x2 merge) without deepstack, up to 8x8 patches an image, videos of up
    to 2 x 4096 pixels a frame group (the processor configs of tests/vl_checkpoints.py)."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config, Qwen3_5MoeConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok, vocab = byte_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config={**TEXT, **(MOE if moe else {}), "vocab_size": vocab},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = [f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             min_pixels=64 * 64, max_pixels=128 * 128,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 8 * 64 * 64},
                          cap_pixels_per_frame=False).save_pretrained(path)
    return path


class Qwen3_5Oracle(Oracle):
    """transformers' Qwen3.5 model over the prompt shoal's processor (Qwen3-VL's) expands;
    logprobs from generate's own scores (its cached decode steps, as shoal's)."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from shoal.multimodal.processors.qwen3_vl import Qwen3VLProcessor

        self.model = AutoModelForImageTextToText.from_pretrained(
            folder, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.config = self.model.config
        self.proc = Qwen3VLProcessor(folder, self.config, self.tok)

    @torch.no_grad()
    def run(self, text: str, images: list, videos: list
            ) -> tuple[list[int], list[int], list[float]]:
        ids, feats = self.expand(text, images, videos)
        x = torch.tensor([ids])
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                  max_new_tokens=STEPS, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, **self.inputs(ids, feats))
        tokens = out.sequences[0, len(ids):].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores,
                                                                              tokens)]
        return ids, tokens, lps


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


def check(out: Any, want: tuple[list[int], list[int], list[float]]) -> None:
    ids, tokens, lps = want
    assert out.prompt_token_ids == ids
    got = out.outputs[0]
    assert list(got.token_ids) == tokens
    for step, tok in enumerate(tokens):
        assert got.logprobs[step][tok].logprob == pytest.approx(lps[step], abs=1e-4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def oracle(folder) -> Qwen3_5Oracle:
    return Qwen3_5Oracle(folder)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    # 32 tokens a step: short prompts prefill whole, longer ones in chunks (the hybrid's
    # blocks are 64 tokens: a page holds a linear layer's state)
    return LLM(model=str(folder), dtype="float32", max_model_len=512,
               max_num_batched_tokens=32, num_gpu_blocks_override=64,
               limit_mm_per_prompt={"image": 2, "video": 1})


def test_tower_and_positions_match_transformers(llm, oracle) -> None:
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    video = Video(noise_frames(3, 4, 64, 96), 2.0)
    ids, feats = oracle.expand(f"a {IMG} b {VID} c", [image(4, 96, 64)], [video])
    hf = oracle.model.model
    with torch.no_grad():
        got = model.embed_multimodal(feats)
        kw = oracle.inputs(ids, feats)
        want = [hf.get_image_features(kw["pixel_values"], kw["image_grid_thw"]),
                hf.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"])]
    for g, w in zip(got, want):  # the merged tokens alone: no deepstack rows
        torch.testing.assert_close(g, w.pooler_output[0], atol=1e-4, rtol=1e-4)
    pos, delta = model.get_mrope_positions(ids, feats)
    ref, ref_delta = hf.get_rope_index(torch.tensor([ids]), kw["mm_token_type_ids"],
                                       image_grid_thw=kw["image_grid_thw"],
                                       video_grid_thw=kw["video_grid_thw"])
    assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)


CASES = {  # prompt, images, videos: each prefills in one step but the video (chunked)
    "text": ("a b c d", [], []),
    "one_image": (f"a b {IMG} c", [image(3, 96, 64)], []),
    "two_images": (f"a {IMG} b {IMG} c", [image(5, 96, 64), image(6, 128, 128)], []),
    "video": (f"a b {VID} c", [], [Video(noise_frames(7, 4, 64, 64), 2.0)]),
}


def _prompt(text: str, images: list, videos: list) -> Any:
    data = {k: v for k, v in (("image", images), ("video", videos)) if v}
    return {"prompt": text, "multi_modal_data": data} if data else text


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(llm, oracle, case) -> None:
    (out,) = llm.generate(_prompt(*CASES[case]), greedy(), use_tqdm=False)
    check(out, oracle.run(*CASES[case]))


def test_mixed_batch_matches_transformers(llm, oracle) -> None:
    """All the cases in one call: image and video rows, 3-D positions and the linear
    layers' states of several requests in the same 32-token steps."""
    outs = llm.generate([_prompt(*c) for c in CASES.values()], greedy(), use_tqdm=False)
    for out, case in zip(outs, CASES.values()):
        check(out, oracle.run(*case))


def test_chunked_prefill_through_an_image(llm, oracle, monkeypatch) -> None:
    placed = record_placed(monkeypatch, llm)
    text = "abcdefghijklmnopqrstuvwxyz" + f"{IMG} z"  # the 32-token step ends in the image
    im = image(8, 96, 64)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, greedy(),
                          use_tqdm=False)
    check(out, oracle.run(text, [im], []))
    assert len(placed) == 2 and sum(placed) == 6  # its 6 rows, over two steps


def test_prefix_hit_before_the_image(llm, oracle) -> None:
    """The second prompt differs from the first only in its image, after 64+ tokens of text:
    it hits the first block (attention pages and the linear layers' state at its end). An
    image inside the first block keeps two prompts from sharing it, unless it is the same
    image (then the hit covers it, and the text after it keeps its M-RoPE shift)."""
    base = " ".join(f"w{i}" for i in range(24))  # 24 * 4 - 1 = 95 tokens
    first, second = image(9, 96, 64), image(10, 96, 64)

    def run(text: str, im: Any) -> Any:
        (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, greedy(),
                              use_tqdm=False)
        return out

    late = [run(f"{base} {IMG} z", im) for im in (first, second)]
    assert [o.num_cached_tokens for o in late] == [0, 64]
    check(late[1], oracle.run(f"{base} {IMG} z", [second], []))
    early = [run(f"a {IMG} {base} {tail}", im)
             for im, tail in ((first, "y"), (second, "y"), (first, "z"))]
    assert [o.num_cached_tokens for o in early] == [0, 0, 64]
    check(early[1], oracle.run(f"a {IMG} {base} y", [second], []))
    check(early[2], oracle.run(f"a {IMG} {base} z", [first], []))


@torch.no_grad()
def test_evs_half_of_a_video_matches_hand_made_transformers(folder, oracle) -> None:
    """EVS at 0.5: transformers' tower output pruned by the reference mask, the kept pads'
    rows and the unpruned prompt's positions at the kept columns, greedy through
    transformers' language model (recomputed whole each step)."""
    video, text, rate = evs_video(), f"a b {VID} c", 0.5
    oracle.proc.video_pruning_rate = 0.0
    ids, (f,) = oracle.expand(text, [], [video])
    kw = oracle.inputs(ids, [f])
    hf = oracle.model.model
    positions, _ = hf.get_rope_index(torch.tensor([ids]), kw["mm_token_type_ids"],
                                     video_grid_thw=kw["video_grid_thw"])
    main = hf.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]
                                 ).pooler_output[0]
    t = int(kw["video_grid_thw"][0, 0])
    keep = reference_mask(main, t, len(main) // t, rate)
    assert keep.reshape(t, -1).sum(1).tolist()[:2] == [4, 0]  # the repeated group dropped
    pad = oracle.config.video_token_id
    columns = np.ones(len(ids), dtype=bool)
    columns[np.flatnonzero(np.asarray(ids) == pad)[~keep.numpy()]] = False
    kept_ids = torch.tensor(ids)[columns]
    x = hf.get_input_embeddings()(kept_ids)
    x[kept_ids == pad] = main[keep]
    x, pos, tokens, lps = x[None], positions[:, :, columns], [], []
    for _ in range(STEPS):
        h = hf.language_model(inputs_embeds=x, position_ids=pos).last_hidden_state
        logprobs = torch.log_softmax(oracle.model.lm_head(h[0, -1]), -1)
        tokens.append(int(logprobs.argmax()))
        lps.append(float(logprobs[tokens[-1]]))
        x = torch.cat([x, hf.get_input_embeddings()(torch.tensor([[tokens[-1]]]))], 1)
        pos = torch.cat([pos, pos.max() + torch.ones(3, 1, 1, dtype=pos.dtype)], -1)

    llm = LLM(model=str(folder), dtype="float32", max_model_len=512,
              max_num_batched_tokens=32, num_gpu_blocks_override=64, video_pruning_rate=rate)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, greedy(),
                          use_tqdm=False)
    # (the prompt holds the planned layout of the kept pads; the model lays the span out
    # by what each frame kept once the tower has run)
    got, want = out.prompt_token_ids, kept_ids.tolist()
    assert len(got) == len(want) and got.count(pad) == want.count(pad) == 8
    end = len(want) - (len(ids) - f.end)
    assert got[:f.offset] == want[:f.offset] and got[end:] == want[end:]
    check(out, (got, tokens, lps))
    (kept,) = llm.llm_engine.core.runner.mm.kept_positions.values()
    span = positions[:, 0, columns][:, f.offset:end]
    assert torch.equal(kept + span[0, 0], span)  # each kept token at its unpruned place


def test_moe_image_matches_transformers(tmp_path) -> None:
    path = write_tiny_qwen3_5_vl(tmp_path, moe=True, seed=1)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, num_gpu_blocks_override=64)
    assert type(llm.llm_engine.core.runner.model).__name__ == (
        "Qwen3_5MoeForConditionalGeneration")
    text, im = f"a b {IMG} c", image(11, 128, 96)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, greedy(),
                          use_tqdm=False)
    check(out, Qwen3_5Oracle(path).run(text, [im], []))


def test_language_model_only_serves_the_text_model(folder, oracle) -> None:
    """Every modality's limit 0: the text model alone (no tower loaded), transformers'
    tokens for text; an image is refused."""
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512,
              num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 0, "video": 0})
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and not hasattr(model, "visual")
    (out,) = llm.generate("a b c d", greedy(), use_tqdm=False)
    check(out, oracle.run("a b c d", [], []))
    with pytest.raises(ValueError, match="image"):
        llm.generate({"prompt": f"a {IMG}", "multi_modal_data": {"image": image(1, 64, 64)}},
                     greedy(), use_tqdm=False)
