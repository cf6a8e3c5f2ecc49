"""The whole engine serving a tiny random Qwen2.5-VL (tests/vl_checkpoints.py) against
transformers' greedy decoding of the same expanded prompt and processor tensors: one image,
two images, chunked prefill through images (prompt logprobs too), prefix-cache hits before,
inside and past an image (and none across a different one), the encoder cache reused for a
repeated image, a batch, preemption, and bad input refused with a ValueError while the engine
keeps serving. Three cases guard bugs found and fixed: an image read from a full encoder
cache evicted by the same plan, a failed encoder run leaving the encoder books naming outputs
the runner lacks, a repeated image counted a hit per chunk.

transformers 5 computes Qwen2.5-VL's 3-D rope positions only when `mm_token_type_ids` is
passed (1 at image tokens); the oracle always passes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from vl_checkpoints import image, record_placed, write_tiny_qwen2_5_vl

from shoal import LLM, SamplingParams

PH = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 8
BLOCK = 16  # the engine's default block size


def words(lo: int, hi: int) -> str:
    return " ".join(f"w{i}" for i in range(lo, hi))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def mm_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


class Oracle:
    """transformers' model and shoal's processor (transformers' image processor inside)."""

    def __init__(self, folder: Path):
        from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        from shoal.multimodal.processors.qwen_vl import QwenVLProcessor

        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.config = AutoConfig.from_pretrained(folder)
        self.proc = QwenVLProcessor(folder, self.config, self.tok)

    def expand(self, text: str, images: list) -> tuple[list[int], list]:
        return self.proc.process(self.tok.encode(text, add_special_tokens=False), images)

    def tensors(self, ids: list[int], features: list) -> dict[str, torch.Tensor]:
        """transformers' image inputs of an expanded prompt (mm_token_type_ids included)."""
        arrays = [f.arrays() for f in features]
        return dict(
            pixel_values=torch.cat([torch.tensor(np.array(a["pixel_values"])) for a in arrays]),
            image_grid_thw=torch.stack([torch.tensor(np.array(a["image_grid_thw"])).reshape(3)
                                        for a in arrays]),
            mm_token_type_ids=(torch.tensor([ids]) == self.config.image_token_id).long())

    @torch.no_grad()
    def run(self, text: str, images: list, max_tokens: int = MAX_TOKENS
            ) -> tuple[list[int], list[int], list[float]]:
        """(expanded prompt, greedy tokens, log-softmax of each chosen token)."""
        ids, features = self.expand(text, images)
        x = torch.tensor([ids])
        out = self.model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
            **self.tensors(ids, features))
        tokens = out.sequences[0, len(ids):].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item()
               for lg, t in zip(out.logits, tokens)]
        return ids, tokens, lps

    @torch.no_grad()
    def prompt_logprobs(self, text: str, images: list) -> list[float]:
        """log-softmax of each prompt token (the first excepted) after the ones before it."""
        ids, features = self.expand(text, images)
        logits = self.model(input_ids=torch.tensor([ids]), **self.tensors(ids, features)).logits
        lps = torch.log_softmax(logits[0].float(), -1)
        return [lps[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def oracle(folder) -> Oracle:
    return Oracle(folder)


def make_llm(folder: Path, **kw) -> LLM:
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s an engine
    args = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=512,
                enable_prefix_caching=True, num_gpu_blocks_override=512)
    return LLM(model=str(folder), **{**args, **kw})


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return make_llm(folder)


def generate(llm: LLM, prompts, max_tokens: int = MAX_TOKENS):
    return llm.generate(prompts, greedy(max_tokens), use_tqdm=False)


def check_against_hf(oracle: Oracle, out, text: str, images: list,
                     max_tokens: int = MAX_TOKENS, logprobs: bool = False) -> None:
    ids, tokens, lps = oracle.run(text, images, max_tokens)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens
    if logprobs:
        got = [pos[t].logprob for pos, t in zip(out.outputs[0].logprobs, tokens)]
        np.testing.assert_allclose(got, lps, rtol=0, atol=1e-4)


# ---- cases --------------------------------------------------------------------------------

def test_one_image_matches_transformers(llm, oracle) -> None:
    text, images = f"w1 w2 {PH} w3", [image(0, 100, 130)]
    (out,) = generate(llm, mm_prompt(text, images))
    assert out.prompt_token_ids.count(oracle.config.image_token_id) > 4
    check_against_hf(oracle, out, text, images, logprobs=True)


def test_two_images_of_different_sizes_match_transformers(llm, oracle) -> None:
    text, images = f"w4 {PH} w5 w6 {PH} w7", [image(1, 100, 130), image(2, 60, 200)]
    (out,) = generate(llm, mm_prompt(text, images))
    _, features = oracle.expand(text, images)
    assert features[0].length != features[1].length
    check_against_hf(oracle, out, text, images, logprobs=True)


@pytest.fixture(scope="module")
def small_steps(folder) -> LLM:
    """Steps of 8 tokens: every image's span is placed over several steps."""
    return make_llm(folder, max_num_batched_tokens=8)


def test_chunked_prefill_through_images(small_steps, oracle, monkeypatch) -> None:
    placed = record_placed(monkeypatch, small_steps)
    text, images = f"w8 w9 w10 {PH} w11 {PH} w12", [image(3, 130, 100), image(4, 90, 90)]
    (out,) = generate(small_steps, mm_prompt(text, images))
    _, features = oracle.expand(text, images)
    assert sum(placed) == sum(f.num_embeds for f in features)
    assert len(placed) >= 4 and max(placed) <= 8
    check_against_hf(oracle, out, text, images, logprobs=True)


def test_prompt_logprobs_through_images_match_transformers(small_steps, oracle) -> None:
    text, images = f"w1 w2 {PH} w3 w4 {PH} w5", [image(26, 100, 130), image(27, 64, 90)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = small_steps.generate(mm_prompt(text, images), params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None
    got = [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])]
    np.testing.assert_allclose(got, oracle.prompt_logprobs(text, images), rtol=0, atol=1e-4)


def test_an_image_twice_in_one_prompt_is_encoded_once(small_steps, oracle) -> None:
    enc, mm = small_steps.llm_engine.core.scheduler.encoders, small_steps.llm_engine.core.runner.mm
    text, images = f"w13 {PH} w14 w15 {PH} w16", [image(20, 100, 130)] * 2
    before = (enc.num_encoded, mm.num_encoded)
    (out,) = generate(small_steps, mm_prompt(text, images))
    assert (enc.num_encoded, mm.num_encoded) == (before[0] + 1, before[1] + 1)
    check_against_hf(oracle, out, text, images)


def test_an_image_twice_in_one_prompt_is_not_a_hit_per_chunk(small_steps) -> None:
    enc = small_steps.llm_engine.core.scheduler.encoders
    hits = enc.num_hits
    generate(small_steps, mm_prompt(f"w17 {PH} w18 {PH} w19", [image(21, 100, 130)] * 2))
    assert enc.num_hits - hits <= 1  # 3: one per chunk of the second span


def test_prefix_hit_on_the_text_before_an_image(llm, oracle) -> None:
    text = f"{words(20, 60)} {PH} w1 w2"  # 40 words: two full blocks before the image
    (a,) = generate(llm, mm_prompt(text, [image(5, 100, 130)]))
    (b,) = generate(llm, mm_prompt(text, [image(6, 100, 130)]))
    offset = text.split().index("<|vision_start|><|image_pad|><|vision_end|>") + 1
    assert offset == 41 and a.num_cached_tokens == 0
    # B reuses the text's blocks, never the block where the (other) image starts
    assert b.num_cached_tokens == (offset // BLOCK) * BLOCK == 32
    check_against_hf(oracle, a, text, [image(5, 100, 130)])
    check_against_hf(oracle, b, text, [image(6, 100, 130)])
    # the same prompt and image again: cached into the image's span, the rest of which
    # reads the encoder cache
    enc = llm.llm_engine.core.scheduler.encoders
    encoded = enc.num_encoded
    (c,) = generate(llm, mm_prompt(text, [image(5, 100, 130)]))
    end = oracle.expand(text, [image(5, 100, 130)])[1][0].end
    assert offset < c.num_cached_tokens < end and enc.num_encoded == encoded
    assert c.outputs[0].token_ids == a.outputs[0].token_ids
    # another ending after the same text and image: cached past the image, whose 3-D
    # positions the rest of the prompt continues from
    longer = text + " " + words(70, 90)
    mm, text_only = llm.llm_engine.core.runner.mm, []
    plain_prepare = mm.prepare

    def prepare(inp) -> None:  # whether the step needs multimodal inputs
        plain_prepare(inp)
        text_only.append(inp.mm is None)

    mm.prepare = prepare
    try:
        (d,) = generate(llm, mm_prompt(longer, [image(5, 100, 130)]))
    finally:
        del mm.prepare
    assert d.num_cached_tokens >= 64 > end
    check_against_hf(oracle, d, longer, [image(5, 100, 130)])
    # its uncached prompt is text after the image: 1-D positions (the three M-RoPE streams
    # are equal there), no multimodal inputs, so on a GPU the step may replay a graph
    assert text_only[0]


def test_repeated_image_is_encoded_once(llm, oracle) -> None:
    enc = llm.llm_engine.core.scheduler.encoders
    mm = llm.llm_engine.core.runner.mm
    img = image(7, 120, 80)
    first, second = f"w30 w31 {PH} w32", f"w40 w41 w42 {PH} w43"
    before = (enc.num_encoded, enc.num_hits, mm.num_encoded)
    (a,) = generate(llm, mm_prompt(first, [img]))
    assert (enc.num_encoded, enc.num_hits, mm.num_encoded) == (
        before[0] + 1, before[1], before[2] + 1)
    (b,) = generate(llm, mm_prompt(second, [img]))
    assert b.num_cached_tokens == 0  # the text differs: the image comes from the encoder cache
    assert (enc.num_encoded, enc.num_hits, mm.num_encoded) == (
        before[0] + 1, before[1] + 1, before[2] + 1)
    check_against_hf(oracle, a, first, [img])
    check_against_hf(oracle, b, second, [img])


BATCH = [(f"w50 {PH} w51", [(8, 100, 130)]),
         (f"w52 w53 {PH} w54 {PH}", [(9, 60, 60), (10, 140, 90)]),
         (f"{words(60, 75)} {PH} w55", [(11, 200, 70)])]


def batch_prompts() -> list[dict]:
    return [mm_prompt(t, [image(*s) for s in sizes]) for t, sizes in BATCH]


def test_a_batch_equals_one_by_one(folder, oracle) -> None:
    """Three image requests in one batch (own engine: nothing cached) give the tokens each
    gives alone, and transformers'."""
    fresh = make_llm(folder, enable_prefix_caching=False)
    batch = generate(fresh, batch_prompts())
    alone = [generate(fresh, p)[0] for p in batch_prompts()]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    for out, (text, sizes) in zip(batch, BATCH):
        check_against_hf(oracle, out, text, [image(*s) for s in sizes])


@pytest.mark.parametrize("prefix_caching, step_tokens", [(False, 512), (False, 16),
                                                         (True, 8)])
def test_preemption_keeps_the_tokens(folder, oracle, prefix_caching, step_tokens) -> None:
    """A pool of 8 blocks of 16 for three requests of 24 to 32 prompt tokens that each grow
    by 40: requests are preempted, their images read again from the encoder cache (never
    encoded twice), and they still give transformers' tokens."""
    tiny_pool = make_llm(folder, num_gpu_blocks_override=8, max_model_len=128,
                         enable_prefix_caching=prefix_caching,
                         max_num_batched_tokens=step_tokens)
    batch = generate(tiny_pool, batch_prompts(), max_tokens=40)
    scheduler = tiny_pool.llm_engine.core.scheduler
    assert scheduler.num_preemptions > 0
    images = sum(len(sizes) for _, sizes in BATCH)
    assert scheduler.encoders.num_encoded == tiny_pool.llm_engine.core.runner.mm.num_encoded
    assert scheduler.encoders.num_encoded == images
    assert scheduler.encoders.num_hits > 0
    for out, (text, sizes) in zip(batch, BATCH):
        check_against_hf(oracle, out, text, [image(*s) for s in sizes], max_tokens=40)


# ---- a full encoder cache, a failed encoder run --------------------------------------------

def test_an_image_read_from_a_full_cache_is_not_evicted_for_the_next(folder, oracle) -> None:
    """The cache (shrunk here to what two images of ~20 tokens nearly fill, as 16384 tokens
    are by a busy server) holds image A unreferenced; a prompt reads A and encodes B, which
    fits only by evicting something other than A."""
    full = make_llm(folder)
    a, b = image(22, 100, 130), image(23, 140, 140)
    sizes = [f.num_embeds for f in oracle.expand(f"{PH} {PH}", [a, b])[1]]
    full.llm_engine.core.scheduler.encoders.cache_size = sum(sizes) - 5
    check_against_hf(oracle, generate(full, mm_prompt(f"w1 {PH} w2", [a]))[0],
                     f"w1 {PH} w2", [a])
    text = f"w3 {PH} w4 {PH} w5"
    check_against_hf(oracle, generate(full, mm_prompt(text, [a, b]))[0], text, [a, b])


def test_a_failed_encoder_run_does_not_poison_its_images(folder, oracle, monkeypatch) -> None:
    """The tower raises once (a transient fault): the step's requests, rerun one at a time,
    and later requests with the same images are served."""
    flaky_llm = make_llm(folder)
    model = flaky_llm.llm_engine.core.runner.mm.model
    real, calls = model.embed_multimodal, []

    def flaky(features):
        calls.append(len(features))
        if len(calls) == 1:
            raise RuntimeError("a transient encoder fault")
        return real(features)

    monkeypatch.setattr(model, "embed_multimodal", flaky)
    cases = [(f"w1 {PH} w2", [image(24, 100, 130)]), (f"w3 {PH} w4", [image(25, 64, 64)])]
    outs = generate(flaky_llm, [mm_prompt(t, ims) for t, ims in cases])
    assert calls[0] == 2  # both images in the step that failed
    for out, (text, images) in zip(outs, cases):
        check_against_hf(oracle, out, text, images)
    (again,) = generate(flaky_llm, mm_prompt(*cases[0]))
    check_against_hf(oracle, again, *cases[0])


# ---- bad input ----------------------------------------------------------------------------

def still_serves(llm: LLM, oracle: Oracle) -> None:
    text, images = f"w90 {PH} w91", [image(12, 64, 64)]
    check_against_hf(oracle, generate(llm, mm_prompt(text, images))[0], text, images)


@pytest.mark.parametrize("mm_data, message", [
    ({"image": [image(13, 64, 64), image(14, 64, 64)]},
     r"1 <\|image_pad\|> placeholders for 2 image"),
    ({"image": 42}, "expected a PIL image or a numpy array, got int"),
    ({"image": np.zeros((8, 8), dtype=np.uint8)}, "uint8 array of shape"),
    ({"audio": [image(15, 64, 64)]}, "unsupported modality 'audio'"),
    ([image(16, 64, 64)], "multi_modal_data must be a dict"),
], ids=["two-images-one-placeholder", "not-an-image", "bad-array", "audio", "not-a-dict"])
def test_bad_image_input_is_refused(llm, oracle, mm_data, message) -> None:
    with pytest.raises(ValueError, match=message):
        generate(llm, {"prompt": f"w1 {PH} w2", "multi_modal_data": mm_data})
    still_serves(llm, oracle)


def test_more_images_than_the_limit(folder, oracle) -> None:
    one = make_llm(folder, limit_mm_per_prompt={"image": 1})
    two = [image(17, 64, 64), image(18, 64, 64)]
    with pytest.raises(ValueError, match=r"at most 1 image\(s\).*limit_mm_per_prompt.*got 2"):
        generate(one, mm_prompt(f"w1 {PH} w2 {PH}", two))
    still_serves(one, oracle)


def test_images_to_a_text_model(tiny_llama_dir) -> None:
    text_llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                   num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": image(19, 64, 64)}}
    with pytest.raises(ValueError, match="does not take images"):
        generate(text_llm, prompt)
    (out,) = generate(text_llm, {"prompt_token_ids": [5, 6, 7]})
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


def test_a_batch_preprocesses_its_images_on_the_media_threads(folder, monkeypatch) -> None:
    """LLM.generate hands a batch's images to the media threads (several at once: their
    preprocessing is the host's largest cost per image request) and keeps the prompts' order."""
    import threading

    llm = make_llm(folder, enable_prefix_caching=False)
    mm = llm.llm_engine.inputs.mm
    seen: list[str] = []
    process = mm.process

    def recording(ids, data):
        seen.append(threading.current_thread().name)
        return process(ids, data)

    monkeypatch.setattr(mm, "process", recording)
    batch = generate(llm, batch_prompts())
    assert len(seen) == len(BATCH) and all(n.startswith("shoal-media") for n in seen)
    monkeypatch.setattr(mm, "process", process)
    alone = [generate(llm, p)[0] for p in batch_prompts()]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


class RecordingGraphs:
    """Stands in for worker/encoder_graphs.EncoderGraphs (CUDA only): records the grids the
    engine asks for and answers with the eager tower, or None (no graph: run eagerly)."""

    def __init__(self, tower, answer: bool):
        self.tower, self.answer, self.grids = tower, answer, []

    def run(self, pixels: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor | None:
        self.grids.append(grid)
        return self.tower(pixels, torch.tensor([list(grid)])) if self.answer else None


@pytest.mark.parametrize("answer", [True, False], ids=["replayed", "no-graph"])
def test_a_lone_image_goes_through_the_encoder_graphs(folder, oracle, answer) -> None:
    """The runner hands the model its EncoderGraphs at capture (graph_capture.py, CUDA); a
    step encoding one image asks them for its grid and uses their output, and runs the tower
    eagerly when they have no graph for it. Both give transformers' tokens."""
    llm = make_llm(folder)
    model = llm.llm_engine.core.runner.model
    model.encoder_graphs = graphs = RecordingGraphs(model.visual, answer)
    text, images = f"w5 {PH} w6 w7", [image(12, 90, 150)]
    (out,) = generate(llm, mm_prompt(text, images))
    (feature,) = oracle.expand(text, images)[1]
    grid = tuple(int(x) for x in np.array(feature.arrays()["image_grid_thw"]).reshape(-1))
    assert graphs.grids == [grid]
    check_against_hf(oracle, out, text, images)
