"""EAGLE-3 and MTP under pipeline parallelism: two gloo stages (the mp executor) against one
rank, as test_spec_pipeline_parallel.py does for the other methods: greedy tokens are the
plain engine's, the acceptance counters the one-rank speculative run's, and every proposal
stage 0 makes is what a plain torch evaluation of the head predicts (the formula of
test_eagle3.py and test_multi_layer_mtp.py).

EAGLE-3: an 8-layer Llama (layers 0-3 on stage 0, 4-7 on stage 1) whose head reads layers
(5, 2, 4), out of order: stage 0 records layer 2's state, stage 1 those of 5 and 4, which
travel back with the final hidden states (shoal/distributed/stage_aux.py). MTP: a DeepSeek-V3
of 3 layers (2 + 1) with three MTP layers on stage 0, drafting 4 tokens (the chain with its
per-request carry, then the last layer alone); its main layers add a small term to a bigram
(the next token mostly a function of the current one), so some drafts are accepted."""

from __future__ import annotations

import json
import re

import pytest
import torch
from deepseek_tiny import V3, write_deepseek
from engine_helpers import random_prompts
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file
from spec_decode.test_eagle3 import LAYERS, Reference, head_weights, write_head
from spec_decode.test_multi_layer_mtp import DEPTHS, DeepseekReference, N, _extra, _save
from spec_decode.test_spec_pipeline_parallel import _run
from transformers import AutoModelForCausalLM

from shoal import SamplingParams
from shoal.distributed.stage_aux import aux_route
from shoal.worker.stage_link import PendingHidden

AUX = (5, 2, 4)


class _OutOfOrderReference(Reference):
    @torch.no_grad()
    def aux(self, seq: list[int]) -> torch.Tensor:
        hs = self.hf.model(torch.tensor([seq]), output_hidden_states=True,
                           use_cache=False).hidden_states
        return torch.cat([hs[i][0] for i in AUX], -1)


@pytest.fixture(scope="module")
def eagle3_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-eagle3")
    target = write_tiny_checkpoint(root / "target", "llama", seed=3, num_hidden_layers=LAYERS)
    w = head_weights(seed=5)
    head = write_head(root / "head", w,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX)})
    return target, head, _OutOfOrderReference(target, w)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """A DeepSeek-V3 target with three MTP layers (depths 0 and 1 the bigram's function of
    their token, depth 2 random) and its DeepseekReference."""
    root = tmp_path_factory.mktemp("pp-mtp")
    full, _ = write_deepseek(root / "full", "deepseek_v3", seed=3,
                             **dict(V3, num_hidden_layers=N + DEPTHS))
    cfg = json.loads((full / "config.json").read_text())
    weights = load_file(full / "model.safetensors")
    near = dict(weights)
    for name, t in weights.items():
        m = re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\..*down_proj)\.weight$",
                     name)
        if m:
            near[name] = t * (0.005 if int(m[1]) < N else 0.02)
    hf = AutoModelForCausalLM.from_pretrained(_save(root / "near-full", cfg, near),
                                              dtype=torch.float32).eval()
    extra = _extra(12, near, {0, 1})
    target = _save(root / "near", cfg, {**near, **extra}, num_hidden_layers=N,
                   num_nextn_predict_layers=DEPTHS)
    return target, DeepseekReference(hf, extra)


def _log_proposals(log: list[tuple[list[int], list[int]]]):
    """before(llm) for _run: every proposal of stage 0's drafter into `log`."""
    def install(llm) -> None:
        runner = llm.llm_engine.core.runner
        drafter = getattr(runner, "driver", runner).drafter
        inner = drafter.mirror_and_propose

        def recording(reqs, hidden, failed, propose=True):
            drafts = inner(reqs, hidden, failed, propose=propose)
            log.extend((r.state.all_token_ids(), drafts[r.serial]) for r in reqs
                       if r.serial in drafts)
            return drafts
        drafter.mirror_and_propose = recording
    return install


def _eagle3_stages(llm) -> None:
    driver = llm.llm_engine.core.runner.driver
    route = driver.model.model.aux_route
    assert route.own == (2,) and route.received == 2 and route.order == (1, 0, 2)


def _mtp_on_stage_0(llm) -> None:
    driver = llm.llm_engine.core.runner.driver
    assert (driver.model.model.start_layer, driver.model.model.end_layer) == (0, 2)
    assert driver.drafter.depths == DEPTHS and len(driver.drafter.kv_layers()) == DEPTHS


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_two_stages_draft_as_one_rank(method, request):
    torch.set_num_threads(1)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(2, seed=6, lo=3, hi=20)
    if method == "eagle3":
        target, head, ref = request.getfixturevalue("eagle3_ckpt")
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
        check = _eagle3_stages
    else:
        target, ref = request.getfixturevalue("mtp_ckpt")
        spec = {"method": "mtp", "num_speculative_tokens": DEPTHS + 1}
        check = _mtp_on_stage_0
    log: list[tuple[list[int], list[int]]] = []
    plain, _ = _run(target, 1, None, prompts, sampling=sp)
    one, one_counts = _run(target, 1, spec, prompts, sampling=sp)
    two, two_counts = _run(target, 2, spec, prompts, check, _log_proposals(log), sampling=sp)
    assert one == plain and two == plain
    assert two_counts == one_counts
    drafts, draft_tokens, accepted = two_counts
    assert drafts > 0 and accepted <= draft_tokens <= spec["num_speculative_tokens"] * drafts
    assert len(log) >= drafts
    for seq, proposal in log:
        assert proposal == ref.drafts(seq, len(proposal)), seq
    if method == "mtp":  # (EAGLE-3's random head: its drafts are mostly rejected)
        assert accepted > 0


@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8)], [(0, 2), (2, 5), (5, 8)]])
def test_aux_states_reach_stage_0_in_the_heads_order(ranges):
    """Each stage's route, and stage 0's assembly of its own states and those travelling
    from the later stages (as StageLink moves them), give one stage's aux_buffer layout."""
    layers, n, h = (8, 2, 5, 4, 2), 3, 4  # the last layer's output, a repeat, out of order
    state = {i: torch.full((n, h), float(i)) for i in set(layers)}
    routes = [aux_route(layers, ranges, s) for s in range(len(ranges))]
    assert sorted(i for r in routes for i in r.own) == sorted(layers)
    assert routes[-1].own[0] == 8  # the last stage records the last layer's output
    travelling: list[torch.Tensor] = []  # [tokens, hidden] planes behind the activations
    for s, route in enumerate(routes[1:], start=1):
        assert route.received == len(travelling), s
        travelling += [state[i] for i in route.own]
    own = (torch.cat([state[i] for i in routes[0].own], dim=-1) if routes[0].own
           else None)  # (stage 0 owns none of them in the 3-stage split)
    final = torch.stack([torch.zeros(n, h), *travelling])  # what stage 0 receives
    pending = PendingHidden(final[0], None, own, final[1:], routes[0])
    assert routes[0].received == len(travelling)
    assert torch.equal(pending.aux_states(), torch.cat([state[i] for i in layers], dim=-1))
    with pytest.raises(ValueError, match="layer 9 is outside the model's layers"):
        aux_route((9,), ranges, 0)
