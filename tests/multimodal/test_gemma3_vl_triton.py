"""Gemma 3's two-way attention among an image's soft tokens on the Triton attention backend
(CUDA's default; here its kernels run in Triton's interpreter): the engine's greedy tokens and
logprobs equal transformers' (fp32, token_type_ids given) for one image and two images in one
step of several requests, for a prefill in chunks of 8 tokens whose image rows read the text
before them from the paged cache, and for a prefix-cache hit on the text before an image whose
image prefills beside another request's decode. The tiny checkpoint and the oracle are
test_gemma3_vl.py's; the spans' pieces are recorded to show where their rows came from. Two
tokens a request: the first is the prefill's, the one the image rows decide; the second reads
the layers' cached keys, which the recomputed rows fed (the interpreter's ~0.15 s a step
keeps the rest to test_gemma3_vl.py's torch-backend runs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import test_gemma3_vl as g3
import torch
from test_gemma3_vl import TEXTS, hf_run, image

import shoal.models.gemma3_vl as gemma3_vl
from shoal import LLM, SamplingParams
from shoal.attention.triton_backend import TritonAttentionBackend

TOKENS = 2
tiny, registered = g3.tiny, g3.registered  # its fixtures, for the tests here


def triton_llm(path: Path, **kw) -> LLM:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, attention_backend="triton",
              num_gpu_blocks_override=512, **kw)
    assert isinstance(llm.llm_engine.core.runner.backend, TritonAttentionBackend)
    return llm


def record_pieces(monkeypatch) -> list[list[tuple[int, ...]]]:
    """Each image step's pieces: (flat rows a, b, metadata row, first position, decode rows)."""
    steps: list[list[tuple[int, ...]]] = []
    cut = gemma3_vl._triton_pieces

    def recording(spans, md):
        pieces = cut(spans, md)
        steps.append([(p.a, p.b, p.row, p.first, md.num_decode_rows) for p in pieces])
        return pieces

    monkeypatch.setattr(gemma3_vl, "_triton_pieces", recording)
    return steps


def generate_and_check(llm: LLM, hf, proc, prompts: list[tuple[str, list]],
                       text_only: tuple[str, ...] = ()) -> list:
    """text_only prompts first (not checked), then the image prompts, in one generate call;
    each image prompt's tokens and logprobs against transformers' generate of it alone."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(list(text_only) + [{"prompt": t, "multi_modal_data": {"image": im}}
                                           for t, im in prompts], params, use_tqdm=False)
    for (text, images), out in zip(prompts, outs[len(text_only):]):
        batch = proc(text=text, images=images, return_tensors="pt")
        assert out.prompt_token_ids == batch["input_ids"][0].tolist()
        tokens, logits = hf_run(hf, batch)
        got = out.outputs[0]
        assert list(got.token_ids) == tokens[:TOKENS]
        want = [torch.log_softmax(lg, -1)[t].item() for lg, t in zip(logits, got.token_ids)]
        np.testing.assert_allclose([p[t].logprob for p, t in zip(got.logprobs, got.token_ids)],
                                   want, rtol=0, atol=1e-4)
    return outs


def test_triton_backend_one_and_two_images(tiny, registered, monkeypatch) -> None:
    path, hf, proc = tiny
    steps = record_pieces(monkeypatch)
    llm = triton_llm(path, max_num_batched_tokens=128)
    one, two = (TEXTS[1], [image(5)]), (TEXTS[2], [image(6), image(7, 20, 64)])
    three = ("w40 w41 w42 <start_of_image> w43", [image(10)])
    generate_and_check(llm, hf, proc, [one, two, three])  # one step prefills all three
    # the tokenizer adds no <bos>; an image is "\n\n" <start_of_image>, 4 soft tokens,
    # <end_of_image> "\n\n": one's soft tokens at 4..7 (rows 4..7), two's at 3..6 and
    # 13..16 (rows 14..17 and 24..27), three's at 5..8 (rows 36..39)
    assert steps == [[(4, 8, 0, 4, 0), (14, 18, 1, 3, 0), (24, 28, 1, 13, 0),
                      (36, 40, 2, 5, 0)]]


def test_triton_backend_chunks_and_prefix_hit(tiny, registered, monkeypatch) -> None:
    """Steps of 8 tokens in blocks of 4: each image's rows read the context before them (on
    the sliding layers, window 8, only within it) through the Triton metadata's block
    tables; then a prompt sharing the first 8 tokens hits the prefix cache and prefills its
    image beside another request's decode."""
    path, hf, proc = tiny
    steps = record_pieces(monkeypatch)
    llm = triton_llm(path, max_num_batched_tokens=8, block_size=4)
    words = " ".join(f"w{i}" for i in range(10, 18))
    generate_and_check(llm, hf, proc, [(words + " <start_of_image> w9", [image(8)])])
    # steps: w10..w17 | "\n\n" <start_of_image>, soft tokens at 10..13 (the sliding layers'
    # keys from 3 on), <end_of_image> "\n\n" | w9
    assert steps == [[(2, 6, 0, 10, 0)]]
    steps.clear()
    # w10..w17 are cached; step 1: "w50 w51" whole, then w33 "\n\n" <start_of_image> (the
    # image does not fit); step 2: "w50 w51" decodes in row 0, the soft tokens at positions
    # 11..14 (the sliding layers' keys from 4 on) are flat rows 1..4 of metadata row 1
    short, out = generate_and_check(llm, hf, proc, [(words + " w33 <start_of_image> w34",
                                                     [image(12)])], text_only=("w50 w51",))
    assert out.num_cached_tokens == 8 and len(short.outputs[0].token_ids) == TOKENS
    assert steps == [[(1, 5, 1, 11, 1)]]
