"""shoal's Idefics3 processor against transformers' Idefics3Processor on a tiny word-level
tokenizer (its pre-tokenizer keeps runs of newlines as one token, as SmolVLM's BPE merges
"\\n\\n") and the PIL image processor: the expanded prompt's token ids, each image's span
and mask, and the pixel arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Idefics3Config,
    PreTrainedTokenizerFast,
)
from transformers import Idefics3Processor as HFIdefics3Processor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from shoal.multimodal.processors.idefics3 import Idefics3Processor

SPECIAL = (["<unk>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
           + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
WORDS = [f"w{i}" for i in range(200)] + ["\n", "\n\n"]
TILE = 32  # max_image_size: a tile's side, the vision tower's image_size
SEQ_LEN = (TILE // 8) ** 2 // 4  # <image> tokens per tile: patch 8, scale_factor 2


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words and runs of newlines are tokens; other whitespace goes
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|[^\s]+"), "removed", invert=True)
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def tiny_config(image_token_id: int) -> Idefics3Config:
    return Idefics3Config(
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 64, "patch_size": 8, "image_size": TILE},
        text_config={"model_type": "llama", "vocab_size": len(SPECIAL) + len(WORDS),
                     "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "intermediate_size": 64},
        scale_factor=2, image_token_id=image_token_id)


def write_folder(path: Path, **image_kwargs) -> Path:
    tiny_tokenizer().save_pretrained(path)
    Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE},
                              max_image_size={"longest_edge": TILE},
                              **image_kwargs).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["split", "no-split"])
def folder(request, tmp_path_factory) -> Path:
    kw = {} if request.param == "split" else {"do_image_splitting": False}
    return write_folder(tmp_path_factory.mktemp(request.param), **kw)


def both_processors(folder: Path) -> tuple[Idefics3Processor, HFIdefics3Processor]:
    tok = AutoTokenizer.from_pretrained(str(folder))
    config = tiny_config(tok.convert_tokens_to_ids("<image>"))
    hf = HFIdefics3Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                             tokenizer=AutoTokenizer.from_pretrained(str(folder)),
                             image_seq_len=SEQ_LEN)
    return Idefics3Processor(folder, config, tok), hf


def image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("text, sizes", [
    ("w1 w2 <image> w3", [(50, 40)]),  # split: 2 x 2 tiles
    ("<image> w5 w6 <image> w7 w8", [(50, 40), (10, 60)]),  # 2 x 2, then 1 x 2
])
def test_expansion_and_pixels_match_transformers(folder: Path, text: str, sizes: list) -> None:
    ours, hf = both_processors(folder)
    images = [image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ref = hf(text=[text], images=images)
    prompt = ours.tokenizer.encode(text, add_special_tokens=False)
    ids, features = ours.process(prompt, images)
    assert ids == list(ref["input_ids"][0])
    if folder.name.startswith("split"):
        assert ours.tokenizer.convert_tokens_to_ids("\n\n") in ids  # the merged newlines
    # each image's tiles, in order, are the slice of transformers' batch that is its own
    pixels = np.concatenate([f.arrays()["pixel_values"] for f in features])
    masks = np.concatenate([f.arrays()["pixel_attention_mask"] for f in features])
    np.testing.assert_array_equal(pixels, np.asarray(ref["pixel_values"][0]))
    np.testing.assert_array_equal(masks, np.asarray(ref["pixel_attention_mask"][0]) != 0)
    check_spans(ids, features, ours.image_token_id)


def check_spans(ids: list[int], features: list, image_id: int) -> None:
    """Spans run from an image's first <image> token to its last, in order, and their masks
    mark exactly the prompt's <image> positions; one tile's worth per pixel tile."""
    covered: list[int] = []
    for f in features:
        span = ids[f.offset:f.end]
        assert span[0] == span[-1] == image_id
        assert list(f.embed_mask) == [int(t == image_id) for t in span]
        covered += [f.offset + i for i, m in enumerate(f.embed_mask) if m]
        assert f.num_embeds == SEQ_LEN * f.arrays()["pixel_values"].shape[0]
    assert covered == [i for i, t in enumerate(ids) if t == image_id]


def test_identifier_follows_the_image_alone(folder: Path) -> None:
    ours, _ = both_processors(folder)
    img, other = image(50, 40, seed=0), image(50, 40, seed=1)
    prompt = ours.tokenizer.encode("<image> w1 <image>", add_special_tokens=False)
    _, (a, b) = ours.process(prompt, [img, other])
    _, (c, d) = ours.process(prompt, [other, img])
    assert a.identifier == d.identifier and b.identifier == c.identifier
    assert a.identifier != b.identifier


def test_text_only_prompt_is_unchanged(folder: Path) -> None:
    ours, _ = both_processors(folder)
    prompt = ours.tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    assert ours.process(prompt, []) == (prompt, [])


@pytest.mark.parametrize("text, n_images", [("w1 <image> w2", 2), ("<image> <image>", 1),
                                            ("w1", 1)])
def test_placeholder_count_must_match_images(folder: Path, text: str, n_images: int) -> None:
    ours, _ = both_processors(folder)
    prompt = ours.tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match=f"{text.count('<image>')} <image> token.* for "
                                         f"{n_images} image"):
        ours.process(prompt, [image(20, 20, seed=i) for i in range(n_images)])
