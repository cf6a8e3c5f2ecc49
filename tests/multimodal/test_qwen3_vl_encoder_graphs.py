"""Qwen3-VL's vision tower under the encoder CUDA graphs (worker/encoder_graphs.py).

On the CPU: the tower's forward is its plan (the host work of a grid) then forward_planned,
which equals transformers' tower for images and a video, gives the same output over a plan
made once and reused, and reads no tensor's values (it runs on the meta device, where a
host sync or a shape taken from data fails, as either would break a graph capture);
EncoderGraphs, its CUDA graph swapped for an eager replay into the same output tensors,
hands back copies of the whole output (main and deepstack features), one graph per image
grid, none for a video; and the engine, given such graphs, sends a lone image through them
and asks them for a lone EVS-pruned video, running the tower itself when they have no
graph, and gives transformers' tokens. On CUDA: real graphs equal the eager tower, with and without deepstack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_qwen3_vl_evs import TEXT as EVS_TEXT
from test_qwen3_vl_evs import evs_video, hand_made
from test_qwen3_vl_video import IMG, Oracle, greedy
from vl_checkpoints import image, write_tiny_qwen3_vl

from shoal import LLM
from shoal.models.vision.qwen3_vl import Qwen3VisionTransformer
from shoal.worker.encoder_graphs import EncoderGraphs

VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
              patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
PATCH_DIM = 3 * 2 * 16 * 16
GRIDS = {"image": [(1, 8, 6)], "two_images": [(1, 8, 6), (1, 4, 4)], "video": [(3, 4, 6)]}


def vision_config(**overrides: Any) -> Any:
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(vision_config={**VISION, **overrides}).vision_config


def random_tower(cfg: Any, device: str = "cpu", seed: int = 0) -> Qwen3VisionTransformer:
    """Large random weights and norms far from 1: a wrong row, corner or segment shows."""
    torch.manual_seed(seed)
    with torch.device(device):
        tower = Qwen3VisionTransformer(cfg, torch.float32).eval()
    with torch.no_grad():
        for p in tower.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return tower


def patches(grids: list[tuple[int, int, int]], seed: int, device: str = "cpu") -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed)).to(device)


def leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a tower output (a tensor, or tuples and lists of them), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for part in out for t in leaves(part)]


@pytest.fixture(scope="module")
def tower() -> Qwen3VisionTransformer:
    return random_tower(vision_config())


# ---- the tower's plan --------------------------------------------------------------------------

@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
@torch.no_grad()
def test_planned_forward_is_the_forward_and_transformers(tower, grids) -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    grid = torch.tensor(grids)
    plan = tower.plan(grid)
    for seed in (1, 2):  # one plan, two images: the plan holds nothing of the pixels
        pixels = patches(grids, seed)
        main, deepstack = tower(pixels, grid)
        planned_main, planned_deepstack = tower.forward_planned(pixels, plan)
        assert torch.equal(planned_main, main)
        assert len(deepstack) == len(planned_deepstack) == 2
        assert all(torch.equal(a, b) for a, b in zip(planned_deepstack, deepstack))
    hf = Qwen3VLVisionModel(vision_config()).eval()
    hf.load_state_dict(dict(tower.named_parameters()))
    want = hf(pixels, grid_thw=grid)
    assert main.shape == (grid.prod(-1).sum() // 4, VISION["out_hidden_size"])
    torch.testing.assert_close(main, want.pooler_output, atol=1e-4, rtol=1e-4)
    for got, ref in zip(deepstack, want.deepstack_features, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
@torch.no_grad()
def test_planned_forward_reads_no_values(grids) -> None:
    """forward_planned on the meta device (tensors without values): it would fail there on
    a host sync (item, tolist, a bool) or a shape read from data (nonzero, a mask index)."""
    with torch.device("meta"):
        tower = Qwen3VisionTransformer(vision_config(), torch.float32)
    plan = tower.plan(torch.tensor(grids))  # (the plan reads the host grid, not the graph)
    n = sum(t * h * w for t, h, w in grids)
    main, deepstack = tower.forward_planned(torch.empty(n, PATCH_DIM, device="meta"), plan)
    assert main.is_meta and main.shape == (n // 4, VISION["out_hidden_size"])
    assert [d.shape for d in deepstack] == [main.shape] * 2
    # the check bites: the whole forward reads the grid's values, which meta lacks
    with pytest.raises((RuntimeError, NotImplementedError)):
        tower(torch.empty(n, PATCH_DIM, device="meta"), torch.tensor(grids, device="meta"))


def test_bad_grid_is_refused(tower) -> None:
    with pytest.raises(ValueError, match="spatial merge size"):
        tower.plan(torch.tensor([(1, 5, 4)]))
    with pytest.raises(ValueError, match="holds no image"):
        tower.plan(torch.zeros(0, 3, dtype=torch.long))
    plan = tower.plan(torch.tensor([(1, 4, 4)]))
    with pytest.raises(ValueError, match="describes 16"):
        tower.forward_planned(torch.zeros(12, PATCH_DIM), plan)


# ---- EncoderGraphs with an eager stand-in for the CUDA graph -----------------------------------

class EagerReplay:
    """Stands in for a torch.cuda.CUDAGraph on the CPU: replay() runs forward_planned again
    over the same input tensor and plan and writes into the same output tensors, as a
    graph's replay does."""

    def __init__(self, tower: Any, inp: torch.Tensor, plan: Any):
        self.tower, self.inp, self.plan = tower, inp, plan
        self.output = tower.forward_planned(inp, plan)

    def replay(self) -> None:
        fresh = self.tower.forward_planned(self.inp, self.plan)
        for held, new in zip(leaves(self.output), leaves(fresh), strict=True):
            held.copy_(new)


class EagerGraphs(EncoderGraphs):
    """EncoderGraphs with EagerReplay for its graphs, recording the grids it is asked for."""

    def __init__(self, tower: Any, max_graphs: int = 8):
        super().__init__(tower, next(tower.parameters()).device, max_graphs)
        self.grids: list[tuple[int, ...]] = []

    def run(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return super().run(pixel_values, grid)

    def _record(self, inp: torch.Tensor, plan: Any) -> tuple[Any, Any]:
        replay = EagerReplay(self.tower, inp, plan)
        return replay, replay.output


@pytest.mark.parametrize("deepstack", [[0, 1], []], ids=["qwen3_vl", "qwen3_5_no_deepstack"])
@torch.no_grad()
def test_graphs_hand_back_the_whole_output_per_grid(deepstack) -> None:
    tower = random_tower(vision_config(deepstack_visual_indexes=deepstack))
    graphs = EagerGraphs(tower, max_graphs=3)
    # (1, 4, 6) and (1, 6, 4): as many patches, other grids
    grids = [(1, 4, 6), (1, 6, 4), (1, 4, 4), (1, 8, 6)]
    video = (3, 4, 6)  # videos are not graphed (their grids seldom repeat): eager
    assert graphs.run(patches([video], 0), video) is None and not graphs.graphs
    # patches that are not the grid's: no replay (the eager tower says what is wrong)
    assert graphs.run(patches([(1, 4, 4)], 1), (1, 4, 6)) is None
    graphs.graphs.clear()
    kept = []
    for round_ in range(2):
        for i, grid in enumerate(grids):
            pixels = patches([grid], 10 * round_ + i)
            got = graphs.run(pixels, grid)
            if grid == grids[3]:
                assert got is None  # past max_graphs: the caller runs the tower itself
                continue
            main, ds = tower(pixels, torch.tensor([grid]))
            assert isinstance(got, tuple) and isinstance(got[1], list)
            assert len(got[1]) == len(deepstack)
            for a, b in zip(leaves(got), [main, *ds], strict=True):
                assert torch.equal(a, b)
            kept.append((got, main))
    assert sorted(graphs.graphs) == sorted(grids[:3]) and graphs.num_replays == 6
    for got, main in kept:  # copies: later replays of the same graph left them as they were
        assert torch.equal(got[0], main)


# ---- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_graphs"))


@pytest.fixture(scope="module")
def oracle(folder) -> Oracle:
    return Oracle(folder)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    # EVS on: it prunes videos only (images are whole); chunks of 8 read the span in slices
    return LLM(model=str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=8,
               video_pruning_rate=0.5, num_gpu_blocks_override=256)


def check(out: Any, tokens: list[int], logprobs: list[float] | None = None) -> None:
    got = out.outputs[0]
    assert list(got.token_ids) == tokens
    for step, tok in enumerate(tokens if logprobs else ()):
        assert got.logprobs[step][tok].logprob == pytest.approx(logprobs[step], abs=1e-4)


@pytest.mark.parametrize("answer", [True, False], ids=["replayed", "no-graph"])
def test_a_lone_image_goes_through_the_encoder_graphs(llm, oracle, answer) -> None:
    """The runner hands the model its EncoderGraphs at capture (graph_capture.py, CUDA); a
    step encoding one image asks them for its grid and uses their output (main and
    deepstack), and runs the tower itself when they have no graph. Both give
    transformers' tokens and logprobs."""
    model = llm.llm_engine.core.runner.model
    before = model.encoder_graphs
    model.encoder_graphs = graphs = EagerGraphs(model.visual, max_graphs=8 if answer else 0)
    try:
        # (another image per case: the engine's encoder cache would serve a repeated one)
        text, images = f"w5 {IMG} w6 w7", [image(20 + answer, 96, 64)]
        (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                              greedy(), use_tqdm=False)
    finally:
        model.encoder_graphs = before
    ids, tokens, lps = oracle.run(text, images, [])
    assert out.prompt_token_ids == ids
    check(out, tokens, lps)
    (feature,) = oracle.expand(text, images, [])[1]
    grid = tuple(int(x) for x in np.asarray(feature.arrays()["image_grid_thw"]).reshape(-1))
    assert graphs.grids == [grid]
    assert graphs.num_replays == int(answer) and len(graphs.graphs) == int(answer)


def test_a_pruned_video_asks_the_graphs_and_runs_eagerly(llm, oracle) -> None:
    """A lone video asks the graphs for its whole (t, h, w) grid; they graph images only, so
    the tower runs eagerly and EVS (prune_video) prunes its output: transformers' tokens over
    the hand-made pruned prompt (test_qwen3_vl_evs.py)."""
    video = evs_video()
    want = hand_made(oracle, video, 0.5)
    model = llm.llm_engine.core.runner.model
    before = model.encoder_graphs
    model.encoder_graphs = graphs = EagerGraphs(model.visual)
    try:
        (out,) = llm.generate({"prompt": EVS_TEXT, "multi_modal_data": {"video": video}},
                              greedy(), use_tqdm=False)
    finally:
        model.encoder_graphs = before
    oracle.proc.video_pruning_rate = 0.5  # (hand_made left it at 0)
    planned, (f,) = oracle.expand(EVS_TEXT, [], [video])  # the prompt: the planned layout
    oracle.proc.video_pruning_rate = 0.0
    assert out.prompt_token_ids == planned and len(planned) == len(want["ids"])
    check(out, want["tokens"])
    # 8 frames of 4x4 patches: asked, not graphed
    assert graphs.grids == [(4, 4, 4)] and graphs.num_replays == 0 and not graphs.graphs
    # the span's rows (greedy tokens of a tiny model barely notice a small error): kept
    # main features and the texts' embeddings in their places, deepstack at the kept pads
    rows = llm.llm_engine.core.runner.mm.cache[f.identifier]
    hidden = want["embeds"].shape[1]
    torch.testing.assert_close(rows[:, :hidden], want["embeds"][f.offset:f.end],
                               atol=1e-4, rtol=1e-4)
    is_pad = want["is_pad"][f.offset:f.end]
    for k, ds in enumerate(want["deepstack"]):
        torch.testing.assert_close(rows[is_pad, hidden * (k + 1):hidden * (k + 2)], ds,
                                   atol=1e-4, rtol=1e-4)


# ---- CUDA -------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("deepstack", [[0, 1], []], ids=["qwen3_vl", "qwen3_5_no_deepstack"])
@torch.no_grad()
def test_cuda_graphs_equal_the_eager_tower(deepstack) -> None:
    tower = random_tower(vision_config(deepstack_visual_indexes=deepstack), "cuda")
    graphs = EncoderGraphs(tower, torch.device("cuda"), max_graphs=2)
    grids = [(1, 8, 6), (1, 4, 6), (1, 6, 6)]  # two images, one past max_graphs
    assert graphs.run(patches([(3, 4, 6)], 0, "cuda"), (3, 4, 6)) is None  # a video: eager
    for round_ in range(2):  # the second round replays each graph after the other's
        for i, grid in enumerate(grids):
            pixels = patches([grid], 10 * round_ + i, "cuda")
            got = graphs.run(pixels, grid)
            if grid == grids[2]:
                assert got is None
                continue
            main, ds = tower(pixels, torch.tensor([grid]))
            for a, b in zip(leaves(got), [main, *ds], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(graphs.graphs) == 2 and graphs.num_replays == 4
