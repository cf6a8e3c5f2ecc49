"""shoal's Gemma3ForConditionalGeneration against transformers' on a tiny random checkpoint
(SigLIP tower of 2 layers on 32 x 32 images of 8 x 8 patches, pooled to 4 tokens an image;
the 4-layer decoder of tests/models/test_gemma3.py, sliding window 8): the processor's
expansion equals transformers' Gemma3Processor, the image features equal
get_image_features, and the whole engine's greedy tokens and logprobs equal transformers'
generate given token_type_ids (so each image's soft tokens attend to each other both ways;
a check shows that this changes the logits), in one prefill step and in steps of 8 tokens
that read the context before an image from the paged cache."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle import randomize_weights
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Config, PreTrainedTokenizerFast
from transformers import Gemma3ForConditionalGeneration as HFGemma3VL
from transformers import Gemma3Processor as HFProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from vl_checkpoints import record_placed

import shoal.models.registry
import shoal.multimodal.processors
from shoal import LLM, SamplingParams
from shoal.loader.build import check_all_loaded
from shoal.models.gemma3_vl import Gemma3ForConditionalGeneration
from shoal.multimodal.processors.gemma3 import Gemma3Processor

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_gemma3 import tiny_text_config  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>"]
VOCAB = SPECIAL + ["\n", "\n\n"] + [f"w{i}" for i in range(201)]
BOI, EOI, SOFT = 4, 5, 6
MAX_TOKENS = 6
ARCH = "Gemma3ForConditionalGeneration"


def image(seed: int, h: int = 40, w: int = 50) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def write_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|[^\s]+"), "removed", invert=True)
    tok.add_special_tokens(SPECIAL)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", extra_special_tokens={"boi_token": "<start_of_image>",
                                                 "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"},
    ).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, HFGemma3VL, HFProcessor]:
    path = tmp_path_factory.mktemp("gemma3_vl")
    cfg = Gemma3Config(
        text_config=tiny_text_config(len(VOCAB)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, patch_size=8, image_size=32,
                           vision_use_head=False),
        mm_tokens_per_image=4, boi_token_index=BOI, eoi_token_index=EOI,
        image_token_index=SOFT, architectures=[ARCH])
    torch.manual_seed(0)
    hf = HFGemma3VL(cfg).eval()
    randomize_weights(hf)
    hf.save_pretrained(path)
    write_tokenizer(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32},
                            do_pan_and_scan=False).save_pretrained(path)
    proc = HFProcessor(image_processor=AutoImageProcessor.from_pretrained(str(path)),
                       tokenizer=AutoTokenizer.from_pretrained(str(path)), image_seq_length=4)
    return path, hf, proc


def ours_processor(path: Path, hf: HFGemma3VL) -> Gemma3Processor:
    return Gemma3Processor(path, hf.config, AutoTokenizer.from_pretrained(str(path)))


TEXTS = {1: "w1 w2 <start_of_image> w3", 2: "w5 <start_of_image> w6 w7 <start_of_image> w8"}


@pytest.mark.parametrize("n", [1, 2])
def test_expansion_matches_transformers_processor(tiny, n: int) -> None:
    path, hf, proc = tiny
    images = [image(i) for i in range(n)]
    ref = proc(text=TEXTS[n], images=images, return_tensors="pt")
    ours = ours_processor(path, hf)
    ids, features = ours.process(ours.tokenizer.encode(TEXTS[n], add_special_tokens=False),
                                 images)
    assert ids == ref["input_ids"][0].tolist()
    soft = [i for f in features for i in range(f.offset, f.end)]
    assert soft == ref["token_type_ids"][0].nonzero().flatten().tolist()
    pixels = np.concatenate([f.arrays()["pixel_values"] for f in features])
    np.testing.assert_allclose(pixels, ref["pixel_values"].numpy(), rtol=0, atol=1e-6)


@torch.inference_mode()
def test_image_features_match_transformers(tiny) -> None:
    path, hf, proc = tiny
    ours = Gemma3ForConditionalGeneration(hf.config, torch.float32, use_triton_ops=False)
    saved = load_file(str(path / "model.safetensors"))  # the Hub's spelling of the names
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.weight" in saved
    check_all_loaded(ours, ours.load_weights(saved.items()), ARCH)
    # transformers 5's own module names (model.vision_tower.*) load too
    check_all_loaded(ours, ours.load_weights(hf.state_dict().items()), ARCH)
    images = [image(3), image(4, 64, 20)]
    pixels = proc(text=TEXTS[2], images=images, return_tensors="pt")["pixel_values"]
    ref = hf.get_image_features(pixels).pooler_output
    _, features = ours_processor(path, hf).process(
        proc.tokenizer.encode(TEXTS[2], add_special_tokens=False), images)
    got = torch.stack(ours.eval().embed_multimodal(features))
    assert got.shape == (2, 4, 64) == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def hf_run(hf: HFGemma3VL, batch: dict, bidirectional: bool = True
           ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's logits."""
    extra = {"token_type_ids": batch["token_type_ids"]} if bidirectional else {}
    out = hf.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      pixel_values=batch["pixel_values"], max_new_tokens=MAX_TOKENS,
                      do_sample=False, output_logits=True, return_dict_in_generate=True,
                      **extra)
    n = batch["input_ids"].shape[1]
    return out.sequences[0, n:].tolist(), [lg[0].float() for lg in out.logits]


@pytest.fixture
def registered(monkeypatch) -> None:
    for arch, module in ((ARCH, "gemma3_vl"), ("Gemma3ForCausalLM", "gemma3")):
        monkeypatch.setitem(shoal.models.registry._MODELS, arch, (f"shoal.models.{module}", arch))
    monkeypatch.setitem(shoal.multimodal.processors._PROCESSORS, ARCH,
                        ("shoal.multimodal.processors.gemma3", "Gemma3Processor"))


def check(llm: LLM, hf: HFGemma3VL, proc: HFProcessor,
          prompts: list[tuple[str, list]]) -> None:
    """The prompts in one generate call (one step prefills them all when the budget allows)
    against transformers' generate of each alone."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im}} for t, im in prompts],
                        params, use_tqdm=False)
    for (text, images), out in zip(prompts, outs):
        batch = proc(text=text, images=images, return_tensors="pt")
        assert out.prompt_token_ids == batch["input_ids"][0].tolist()
        tokens, logits = hf_run(hf, batch)
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        want = [torch.log_softmax(lg, -1)[t].item() for lg, t in zip(logits, tokens)]
        np.testing.assert_allclose([p[t].logprob for p, t in zip(got.logprobs, tokens)],
                                   want, rtol=0, atol=1e-4)


def test_engine_matches_transformers(tiny, registered) -> None:
    path, hf, proc = tiny
    # 512 blocks: the CPU default (4 GiB) is ~350k block objects, ~1 s to build
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=128,
              num_gpu_blocks_override=512)
    assert isinstance(llm.llm_engine.core.runner.model, Gemma3ForConditionalGeneration)
    one, two = (TEXTS[1], [image(5)]), (TEXTS[2], [image(6), image(7, 20, 64)])
    check(llm, hf, proc, [one])
    check(llm, hf, proc, [two])
    three = ("w40 w41 w42 <start_of_image> w43", [image(10)])
    check(llm, hf, proc, [one, two, three])  # several requests in one step


def test_engine_in_steps_of_eight_tokens(tiny, registered, monkeypatch) -> None:
    """Each image's 8-token text (newlines, markers, 4 soft tokens) sits inside one step of
    8: its rows read the context before it (and, on sliding layers, within the window) from
    the paged cache."""
    path, hf, proc = tiny
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=8,
              block_size=4, num_gpu_blocks_override=512)  # default: 1.4M blocks, ~2 s
    placed = record_placed(monkeypatch, llm)
    text = " ".join(f"w{i}" for i in range(10, 18)) + " <start_of_image> <start_of_image> w9"
    check(llm, hf, proc, [(text, [image(8), image(9)])])
    assert placed == [4, 4]  # one whole image a step


@torch.no_grad()
def test_bidirectional_attention_changes_the_logits(tiny) -> None:
    """Without token_type_ids transformers attends causally over the images: the engine test
    above would not notice a causal implementation unless the two differ."""
    _, hf, proc = tiny
    batch = proc(text=TEXTS[1], images=[image(5)], return_tensors="pt")
    _, both = hf_run(hf, batch)
    _, causal = hf_run(hf, batch, bidirectional=False)
    assert (both[0] - causal[0]).abs().max() > 1e-2
