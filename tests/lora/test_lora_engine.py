"""LoRA through the offline engine, with PEFT as the oracle: adapters of several shapes mixed
with the base model in one batch (Llama and Qwen3), a merged checkpoint served plainly, more
adapters than device slots and host slots, the prefix cache kept apart per adapter, bad
adapters refused while the engine serves on, a Qwen3-MoE base whose attention takes an
adapter and on its experts, two tensor-parallel ranks, and ngram verify steps."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
from oracle import check_against_hf, draft_continuations, hf_greedy, write_tiny_checkpoint
from peft_adapters import ATTN, peft_model, write_adapter, write_raw_adapter

from shoal import LLM, SamplingParams
from shoal.engine.core import EngineCore
from shoal.engine.scheduler import Scheduler
from shoal.lora.request import LoRARequest

STEPS = 8
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9],
           [1, 2, 3, 4], [100, 200, 300, 400, 500, 60, 70], [33, 44, 55, 66, 77]]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)

# write_adapter settings, each adapter unlike the others in what the engine must get right.
ADAPTERS = [
    dict(r=8, alpha=16),  # every projection
    dict(r=4, alpha=32, use_rslora=True),  # scale alpha / sqrt(r), a rank below the slots'
    # attention only, and k_proj left out of the fused qkv projection (its rows stay zero)
    dict(r=8, alpha=8, targets=["q_proj", "v_proj", "o_proj"]),
    # MLP only, gate_proj left out of the fused gate_up projection
    dict(r=4, alpha=16, targets=["up_proj", "down_proj"]),
    # per-module rank and alpha (PEFT's rank_pattern / alpha_pattern), the last layer only
    dict(r=8, alpha=16, rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 4},
         layers_to_transform=[1]),
]
# Qwen3-MoE small enough for the CPU; layer 1 is a dense MLP among the MoE layers.
QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)


@pytest.fixture(autouse=True)
def step_failures(monkeypatch) -> list[Exception]:
    """The errors of steps the engine recovered from. A failed step is retried one request
    at a time, which would hide a LoRA error behind correct outputs: none is allowed unless
    the test empties the list."""
    seen: list[Exception] = []
    recover = EngineCore._recover

    def recording(self, error):
        seen.append(error)
        return recover(self, error)

    monkeypatch.setattr(EngineCore, "_recover", recording)
    yield seen
    assert not seen, f"engine steps failed: {seen}"


def greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)


def lora(adapter: Path, lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, str(adapter))


@functools.cache
def oracle(base: Path, adapter: Path | None):
    """PEFT's model of the adapter over the base (None: the base), loaded once per module run."""
    return peft_model(base, adapter)


def check_each(outs, prompts, base: Path, adapters: list[Path | None]) -> None:
    """Every output's tokens and chosen-token logprobs against its own adapter's PEFT model."""
    for i, (out, prompt, adapter) in enumerate(zip(outs, prompts, adapters, strict=True)):
        try:
            check_against_hf([out], [prompt], oracle(base, adapter), STEPS)
        except AssertionError as e:  # (oracle.py's asserts carry no message)
            name = "the base" if adapter is None else adapter.name
            raise AssertionError(f"output {i} differs from PEFT's with {name}: "
                                 f"{out.outputs[0].token_ids}") from e


def peft_tokens(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    return hf_greedy(oracle(base, adapter), prompt, STEPS)[0]


def record_adapters_per_step(monkeypatch, llm: LLM) -> list[int]:
    """The number of distinct adapters of each step the runner runs from now on."""
    slots = runner(llm).lora
    seen: list[int] = []
    set_step = slots.set_step

    def recording(loras, num_tokens):
        seen.append(len({x.lora_int_id for x in loras if x is not None}))
        set_step(loras, num_tokens)

    monkeypatch.setattr(slots, "set_step", recording)
    return seen


def runner(llm: LLM):
    """The rank-0 model runner in this process (the driver under a multi-rank executor)."""
    core = llm.llm_engine.core
    return getattr(core.runner, "driver", core.runner)


class Family:
    """A tiny random base checkpoint and the ADAPTERS written for it."""

    def __init__(self, folder: Path, model_type: str, seed: int, **overrides):
        self.base = write_tiny_checkpoint(folder / "base", model_type, seed=seed, **overrides)
        self.adapters = [write_adapter(self.base, folder / f"adapter{i}", seed=seed * 10 + i + 1,
                                       **kw) for i, kw in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Family:
    return Family(tmp_path_factory.mktemp("lora-llama"), "llama", seed=1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Family:
    return Family(tmp_path_factory.mktemp("lora-qwen3"), "qwen3", seed=2)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def mixed(request):
    """A family and an engine with a device slot for each of four adapters. Steps of at most
    16 tokens: the prompts (38 tokens) prefill in chunks beside other requests' decodes, so a
    step's rows mix adapters, prefill chunks and decodes."""
    family = request.getfixturevalue(request.param)
    llm = LLM(model=str(family.base), enable_lora=True, max_loras=4, max_lora_rank=8,
              max_num_batched_tokens=16, **ENGINE)
    yield family, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def two_slots(llama):
    """Two device slots and two adapters in host memory: the tight case."""
    llm = LLM(model=str(llama.base), enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=8, **ENGINE)
    yield llm
    llm.shutdown()


# ---- adapters mixed in one batch ------------------------------------------------------------
def test_four_adapters_and_the_base_in_one_batch(mixed, monkeypatch):
    family, llm = mixed
    per_step = record_adapters_per_step(monkeypatch, llm)
    a = family.adapters
    # adapter 0 twice, apart, and the base between the others: steps mix all five
    chosen = [a[0], a[1], None, a[2], a[3], a[0]]
    requests = [None if p is None else lora(p, a.index(p) + 1) for p in chosen]
    outs = llm.generate(PROMPTS, greedy(), lora_request=requests, use_tqdm=False)
    check_each(outs, PROMPTS, family.base, chosen)
    assert max(per_step) == 4


def test_one_adapter_for_every_prompt(mixed):
    """A single LoRARequest applies to every prompt of the call."""
    family, llm = mixed
    outs = llm.generate(PROMPTS[:3], greedy(), lora_request=lora(family.adapters[4], 5),
                        use_tqdm=False)
    check_each(outs, PROMPTS[:3], family.base, [family.adapters[4]] * 3)


@pytest.fixture(scope="module")
def merged(llama, tmp_path_factory):
    """PEFT's merge of adapter 0 into the base weights, saved as a plain checkpoint and served
    without LoRA."""
    folder = tmp_path_factory.mktemp("lora-merged")
    model = peft_model(llama.base, llama.adapters[0]).merge_and_unload()
    model.save_pretrained(folder, safe_serialization=True)
    llm = LLM(model=str(folder), **ENGINE)
    yield llm
    llm.shutdown()


def test_merged_checkpoint_generates_what_the_adapter_does(llama, merged):
    outs = merged.generate(PROMPTS, greedy(), use_tqdm=False)
    check_each(outs, PROMPTS, llama.base, [llama.adapters[0]] * len(PROMPTS))


def test_lora_request_needs_enable_lora(llama, merged):
    with pytest.raises(ValueError, match="enable_lora"):
        merged.generate(PROMPTS[:1], greedy(), lora_request=lora(llama.adapters[0], 1),
                        use_tqdm=False)


def test_lora_request_list_needs_one_entry_per_prompt(llama, two_slots):
    with pytest.raises(ValueError, match="one entry per prompt"):
        two_slots.generate(PROMPTS[:3], greedy(), lora_request=[None, None], use_tqdm=False)


# ---- more adapters than slots ---------------------------------------------------------------
def test_five_adapters_through_two_slots(llama, two_slots, monkeypatch):
    """Five adapters and the base in one call with two device slots and two host slots: the
    scheduler holds back the requests of a third adapter (a step with three would raise in
    LoRASlots.set_step), every output is its adapter's, and a second round reads adapters
    evicted from host memory again."""
    slots = runner(two_slots).lora
    per_step = record_adapters_per_step(monkeypatch, two_slots)
    chosen = [*llama.adapters, None]
    requests = [None if p is None else lora(p, 11 + i) for i, p in enumerate(chosen)]
    loads = slots.loads
    first = two_slots.generate(PROMPTS, greedy(), lora_request=requests, use_tqdm=False)
    check_each(first, PROMPTS, llama.base, chosen)
    assert max(per_step) == 2  # two adapters share a step, never three
    second = two_slots.generate(PROMPTS, greedy(), lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    # five adapters, twice, through a host LRU of two: each round reads at least three again
    assert slots.loads - loads > len(llama.adapters)
    assert len(slots.host) <= 2


# ---- prefix cache ---------------------------------------------------------------------------
def test_prefix_cache_is_kept_apart_per_adapter(llama, two_slots):
    """One 40-token prompt (two full blocks of 16) under adapter A, B, the base, A again, and
    A's id with B's folder: only A's repeat finds cached blocks, and each output is its own
    adapter's."""
    prompt = [(7 * i + 3) % 500 + 3 for i in range(40)]
    a, b = llama.adapters[0], llama.adapters[1]
    runs = [(a, lora(a, 21)), (b, lora(b, 22)), (None, None), (a, lora(a, 21)),
            (b, LoRARequest("reused-id", 21, str(b)))]
    cached = []
    for adapter, request in runs:
        (out,) = two_slots.generate([prompt], greedy(), lora_request=request, use_tqdm=False)
        check_against_hf([out], [prompt], oracle(llama.base, adapter), STEPS)
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[4] == 0
    assert cached[3] > 0


def test_one_id_for_two_folders_in_flight(llama, two_slots):
    """Two requests in flight with one lora_int_id but two folders: each gets its own folder's
    adapter (or the call is refused), and no KV block computed under one is served later to
    the other through the prefix cache."""
    prompt = [(11 * i + 5) % 500 + 3 for i in range(40)]
    a, b = llama.adapters[0], llama.adapters[1]
    requests = [LoRARequest("x", 60, str(a)), LoRARequest("y", 60, str(b))]
    try:
        outs = two_slots.generate([prompt, prompt], greedy(), lora_request=requests,
                                  use_tqdm=False)
    except ValueError:
        pass  # refusing the call is as good
    else:
        check_each(outs, [prompt, prompt], llama.base, [a, b])
    # what a later request of the id with folder a computes, or takes from the cache
    (out,) = two_slots.generate([prompt], greedy(), lora_request=requests[0], use_tqdm=False)
    check_against_hf([out], [prompt], oracle(llama.base, a), STEPS)


# ---- bad adapters ---------------------------------------------------------------------------
def _copy_config_only(llama, folder: Path) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes(
        (llama.adapters[0] / "adapter_config.json").read_bytes())
    return folder


def _garbage_weights(llama, folder: Path) -> Path:
    _copy_config_only(llama, folder)
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
    return folder


def _other_base(llama, folder: Path) -> Path:
    """An adapter of a Llama with hidden_size 32: every shape differs from the served base."""
    other = write_tiny_checkpoint(folder / "base", "llama", seed=5, hidden_size=32,
                                  intermediate_size=64)
    return write_adapter(other, folder / "adapter", seed=5)


BAD_ADAPTERS = {
    "rank over max_lora_rank": (lambda f, p: write_adapter(f.base, p, seed=31, r=16),
                                r"rank 16 .*max_lora_rank \(8\)"),
    "another base model": (_other_base, "another base model"),
    "missing folder": (lambda f, p: p / "nowhere", "does not exist"),
    "no weights file": (_copy_config_only, "no adapter_model.safetensors"),
    "weights not safetensors": (_garbage_weights, "not a safetensors file"),
    # PEFT saves the whole lm_head beside A and B (save_embedding_layers)
    "lm_head": (lambda f, p: write_adapter(f.base, p, seed=32, targets=["lm_head"]),
                "lm_head"),
    "lm_head A and B only": (lambda f, p: write_raw_adapter(
        p, {"lm_head": (64, 512)}, seed=36, leaves=("lm_head",)), "LM head"),
    "embed_tokens": (lambda f, p: write_adapter(f.base, p, seed=33, targets=["embed_tokens"]),
                     "embed_tokens"),
    "embed_tokens A and B only": (lambda f, p: write_raw_adapter(
        p, {"model.embed_tokens": (512, 64)}, seed=37, leaves=("embed_tokens",)),
        "token embedding"),
    "DoRA": (lambda f, p: write_adapter(f.base, p, seed=34, use_dora=True), "DoRA"),
    "trained biases": (lambda f, p: write_adapter(f.base, p, seed=35, bias="lora_only"),
                       "bias"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapter_is_refused_and_the_engine_serves_on(case, llama, two_slots,
                                                         tmp_path):
    make, message = BAD_ADAPTERS[case]
    bad = lora(make(llama, tmp_path / "bad"), 40)
    good = lora(llama.adapters[0], 1)
    with pytest.raises(ValueError, match=message):
        two_slots.generate(PROMPTS[:1], greedy(), lora_request=bad, use_tqdm=False)
    # the whole call is refused when one of its requests is: the good one does not run either
    with pytest.raises(ValueError, match=message):
        two_slots.generate(PROMPTS[:2], greedy(), lora_request=[good, bad], use_tqdm=False)
    assert not two_slots.llm_engine.has_unfinished_requests()
    (out,) = two_slots.generate(PROMPTS[:1], greedy(), lora_request=good, use_tqdm=False)
    assert out.outputs[0].token_ids == peft_tokens(llama.base, llama.adapters[0], PROMPTS[0])


@pytest.mark.parametrize("setting", [dict(runner="pooling"), dict(model_impl="transformers")])
def test_enable_lora_refused_where_it_cannot_run(llama, setting):
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=str(llama.base), enable_lora=True, **setting, **ENGINE)


def run_with_deleted_adapter(llm: LLM, adapter: Path, tmp_path: Path, lora_id: int,
                             step_failures: list[Exception], with_base: bool = False
                             ) -> dict[str, Any]:
    """A request whose adapter folder is deleted after the frontend checked it (and, with
    with_base, a base-model request beside it), stepped to the end: the doomed one ends with
    finish_reason 'error' through a step failure naming the missing folder. Returns the
    finished outputs by request id."""
    doomed = tmp_path / "doomed"
    shutil.copytree(adapter, doomed)
    engine = llm.llm_engine
    engine.add_request("doomed", {"prompt_token_ids": PROMPTS[0]}, greedy(),
                       lora_request=lora(doomed, lora_id))
    if with_base:
        engine.add_request("base", {"prompt_token_ids": PROMPTS[1]}, greedy())
    shutil.rmtree(doomed)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["doomed"].outputs[0].finish_reason == "error"
    assert step_failures and all("does not exist" in str(e) for e in step_failures)
    step_failures.clear()
    return finished


def test_adapter_gone_before_its_step_fails_that_request_only(llama, two_slots, tmp_path,
                                                             step_failures):
    """An adapter folder deleted after its request was checked: the worker cannot read it, that
    request ends with finish_reason 'error', the others of its step complete, and the engine
    serves on."""
    finished = run_with_deleted_adapter(two_slots, llama.adapters[1], tmp_path, 50,
                                        step_failures, with_base=True)
    check_against_hf([finished["base"]], [PROMPTS[1]], oracle(llama.base, None), STEPS)
    (out,) = two_slots.generate(PROMPTS[:1], greedy(), lora_request=lora(llama.adapters[0], 1),
                                use_tqdm=False)
    check_against_hf([out], PROMPTS[:1], oracle(llama.base, llama.adapters[0]), STEPS)


# ---- Qwen3-MoE ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-moe")
    base = write_tiny_checkpoint(folder / "base", "qwen3_moe", seed=3, **QWEN3_MOE)
    llm = LLM(model=str(base), enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_target_modules=["all-linear", "experts"], **ENGINE)
    yield base, folder, llm
    llm.shutdown()


def test_moe_attention_adapter_matches_peft(moe):
    base, folder, llm = moe
    adapter = write_adapter(base, folder / "attention", seed=41, targets=ATTN)
    chosen = [adapter, None, adapter]
    requests = [None if p is None else lora(p, 1) for p in chosen]
    outs = llm.generate(PROMPTS[:3], greedy(), lora_request=requests, use_tqdm=False)
    check_each(outs, PROMPTS[:3], base, chosen)


def _peft_experts(base: Path, path: Path) -> Path:
    """PEFT over transformers' fused expert tensors (target_parameters): one lora_A/lora_B
    pair per layer, on the module `model.layers.N.mlp.experts`."""
    return write_adapter(base, path, seed=42, r=4, targets=["q_proj"],
                         target_parameters=["mlp.experts.gate_up_proj"])


def test_moe_expert_adapter_served(moe, tmp_path):
    """An adapter on the experts (PEFT's stacked layout) gives the PEFT model's tokens; the
    base is unchanged after it (more layouts: tests/lora/test_lora_moe_experts.py)."""
    base, _, llm = moe
    path = _peft_experts(base, tmp_path / "a")
    (out,) = llm.generate(PROMPTS[:1], greedy(), lora_request=lora(path, 2), use_tqdm=False)
    assert out.outputs[0].token_ids == peft_tokens(base, path, PROMPTS[0])
    (out,) = llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == peft_tokens(base, None, PROMPTS[0])


# ---- tensor parallelism ---------------------------------------------------------------------
@pytest.mark.parametrize("model_type, kv_heads", [("llama", 2), ("qwen3", 1)],
                         ids=["llama", "qwen3-replicated-kv"])
def test_two_tensor_parallel_ranks(model_type, kv_heads, tmp_path, step_failures):
    """tensor_parallel_size=2 on the CPU (two processes over gloo): each rank takes its slice
    of A (row-parallel) or B (column-parallel, the q, k and v parts of the fused projection
    apart), and outputs still match PEFT. One KV head over two ranks: both ranks hold it and
    the whole of its B rows. An adapter that cannot be read fails its step on the driver before
    any rank starts it: that request ends with an error and both ranks serve on."""
    family = Family(tmp_path, model_type, seed=7, num_key_value_heads=kv_heads)
    llm = LLM(model=str(family.base), enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=2, **ENGINE)
    try:
        assert runner(llm).model.attention_layers()[0].num_heads * 2 == 4  # really split
        chosen = [family.adapters[0], None, family.adapters[2]]
        requests = [None if p is None else lora(p, i + 1) for i, p in enumerate(chosen)]
        outs = llm.generate(PROMPTS[:3], greedy(), lora_request=requests, use_tqdm=False)
        run_with_deleted_adapter(llm, family.adapters[1], tmp_path, 9, step_failures)
        again = llm.generate(PROMPTS[:1], greedy(), lora_request=requests[:1], use_tqdm=False)
    finally:
        llm.shutdown()
    check_each(outs, PROMPTS[:3], family.base, chosen)
    check_each(again, PROMPTS[:1], family.base, chosen[:1])


# ---- speculative decoding -------------------------------------------------------------------
def test_health_check_after_an_adapter_step(llama, two_slots):
    """The engine's health check (a made-up one-token step, run after failed steps) works
    after a step of several tokens with an adapter: the slot table is reset for it."""
    two_slots.generate(PROMPTS[:2], greedy(), lora_request=lora(llama.adapters[0], 1),
                       use_tqdm=False)
    runner(two_slots).check_health()
    (out,) = two_slots.generate(PROMPTS[:1], greedy(), lora_request=lora(llama.adapters[0], 1),
                                use_tqdm=False)
    check_against_hf([out], PROMPTS[:1], oracle(llama.base, llama.adapters[0]), STEPS)


def test_ngram_verify_steps_keep_each_requests_adapter(llama, monkeypatch):
    """Verify steps run several tokens per request: each of them takes its request's adapter.
    The drafts are PEFT's own continuations, one step in two with a wrong token, so some are
    accepted and some rejected; the tokens stay PEFT's."""
    chosen = [llama.adapters[0], None, llama.adapters[3]]
    steps = 2 * STEPS
    refs = {tuple(p): hf_greedy(oracle(llama.base, a), p, steps)[0]
            for p, a in zip(PROMPTS, chosen)}
    draft_continuations(monkeypatch, refs)
    verified: list[tuple[int, int]] = []
    settle = Scheduler._settle_verified

    def count(self, req, num_drafts: int, accepted: int) -> None:
        verified.append((num_drafts, accepted))
        settle(self, req, num_drafts, accepted)

    monkeypatch.setattr(Scheduler, "_settle_verified", count)
    llm = LLM(model=str(llama.base), enable_lora=True, max_loras=2, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive_budget": False}, **ENGINE)
    try:
        requests = [None if p is None else lora(p, i + 1) for i, p in enumerate(chosen)]
        outs = llm.generate(PROMPTS[:3], greedy(steps), lora_request=requests,
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)] for p in PROMPTS[:3]]
    drafts, accepted = map(sum, zip(*verified))
    assert 0 < accepted < drafts
