"""Structured outputs through the engine, on SmolLM2's shape (4 layers) and tokenizer with random
weights: random output is the hard case, since only the grammar keeps it valid."""

from __future__ import annotations

import json
import re
import threading

import pytest

from shoal import LLM, SamplingParams
from shoal.core.errors import ErrorCode
from shoal.engine.request_errors import BadRequestError
from shoal.spec_decode.host_drafter import HostDrafter
from shoal.structured_output.params import StructuredOutputsParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.usefixtures("both_cores")

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "kind": {"enum": ["a", "b", "c"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["id", "kind", "tags", "inner"]}
# SmolLM2's shape at 4 of its 30 layers (its vocabulary and tokenizer whole): random weights
# either way, and steps 7x cheaper.
DUMMY = dict(load_format="dummy", max_model_len=512, kv_cache_memory_bytes=64 << 20,
             hf_overrides={"num_hidden_layers": 4})


@pytest.fixture(scope="module")
def llm(smollm_gguf):
    llm = LLM(**DUMMY,
              max_num_seqs=16)
    yield llm
    llm.shutdown()


def _params(so: StructuredOutputsParams, **kw) -> SamplingParams:
    base = dict(temperature=1.0, seed=0, max_tokens=120)
    base.update(kw)
    return SamplingParams(structured_outputs=so, **base)


def test_choice_and_regex_hold_under_random_weights(llm):
    choices = ["alpha", "beta gamma", "δ"]
    outs = llm.generate(["a"] * 6, [_params(StructuredOutputsParams(choice=choices), seed=i)
                                    for i in range(6)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop"
    pattern = r"[a-z]{2,5}-[0-9]{3}"
    outs = llm.generate(["b"] * 6, [_params(StructuredOutputsParams(regex=pattern), seed=i)
                                    for i in range(6)], use_tqdm=False)
    for o in outs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text


def test_json_schema_outputs_validate_or_end_by_length(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(["c"] * 6, [_params(so, seed=i) for i in range(6)], use_tqdm=False)
    stopped = 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            stopped += 1
        else:
            assert c.finish_reason == "length"
    assert stopped >= 3  # the schema is small: most random answers complete


def test_a_grammar_that_cannot_finish_ends_by_length(llm):
    so = StructuredOutputsParams(regex="a{50}")
    out = llm.generate(["d"], _params(so, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_the_grammar_stops_even_with_ignore_eos(llm):
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["e"], _params(so, ignore_eos=True, max_tokens=50),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) <= 3  # the answer and its stop token


def test_mixed_batch_leaves_free_rows_alone(llm):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["f"], free, use_tqdm=False)[0].outputs[0].token_ids
    so = _params(StructuredOutputsParams(choice=["x", "y"]))
    outs = llm.generate(["f", "g", "f"], [free, so, free], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone == outs[2].outputs[0].token_ids
    assert outs[1].outputs[0].text in ("x", "y")


@pytest.mark.parametrize("so,match", [
    (StructuredOutputsParams(regex="(?=a)b"), "Lookahead"),
    (StructuredOutputsParams(json={"type": 5}), "structured_outputs.json"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "structured_outputs.grammar"),
])
def test_bad_constraints_are_value_errors_offline(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["h"], _params(so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_grammar_failing_in_the_engine_is_a_bad_request_offline(llm):
    """Past the offline validation (as a server request is), the engine's compilation fails
    the request with ErrorCode.BAD_REQUEST, and the batch raises a ValueError for it, with
    the free request's answer on the error."""
    eng = llm.llm_engine
    bad = eng.inputs.process_request("bad", "h", _params(StructuredOutputsParams(
        regex="(?=a)b")))
    free = eng.inputs.process_request("free", "h", SamplingParams(max_tokens=3,
                                                                  ignore_eos=True))
    for r in (bad, free):
        eng.submit(r)
    with pytest.raises(ValueError, match="Lookahead") as raised:
        llm._run(["bad", "free"], use_tqdm=False)
    assert isinstance(raised.value, BadRequestError)
    assert raised.value.code == ErrorCode.BAD_REQUEST
    failed, answered = raised.value.outputs
    assert failed.error_code == ErrorCode.BAD_REQUEST and answered.error is None
    assert len(answered.outputs[0].token_ids) == 3 and not eng.has_unfinished_requests()


def test_a_request_waits_only_for_its_own_grammar(llm):
    """A slow compilation holds back its own request; a free one runs to the end meanwhile."""
    eng = llm.llm_engine
    manager = eng.core.structured.manager
    release = threading.Event()
    compile_ = manager._compile

    def slow(params):
        release.wait(30)
        return compile_(params)

    manager._compile = slow
    try:
        # submit: past the offline validation, which would wait for the compilation
        eng.submit(eng.inputs.process_request(
            "slow", "i", _params(StructuredOutputsParams(regex="z{1,3}"))))
        eng.add_request("free", "j", SamplingParams(temperature=0, max_tokens=5,
                                                    ignore_eos=True))
        done = {}
        while "free" not in done:
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        assert "slow" not in done and eng.core.scheduler.requests["slow"].num_output_tokens == 0
    finally:
        release.set()
        manager._compile = compile_
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert re.fullmatch("z{1,3}", done["slow"].outputs[0].text)


def test_unknown_backend_and_missing_library_are_value_errors():
    from shoal.engine.engine_args import EngineArgs

    with pytest.raises(ValueError, match="backend must be one of"):
        EngineArgs(structured_outputs_config='{"backend": "outlines"}').create_engine_config(
            type("C", (), {"vocab_size": 10, "max_position_embeddings": 64})())


def test_guidance_backend_holds_the_same_constraints(llm):
    pytest.importorskip("llguidance")
    from shoal.structured_output.manager import StructuredOutputManager

    core = llm.llm_engine.core
    xgrammar_manager = core.structured.manager
    core.structured.manager = StructuredOutputManager(
        "guidance", llm.get_tokenizer(), core.runner.vocab_size, sorted(core.eos_token_ids))
    try:
        outs = llm.generate(["a", "b", "c"], [
            _params(StructuredOutputsParams(choice=["one", "two words"]), seed=1),
            _params(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), seed=2),
            _params(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), seed=3),
        ], use_tqdm=False)
        assert outs[0].outputs[0].text in ("one", "two words")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)
        c = outs[2].outputs[0]
        assert c.finish_reason == "length" or jsonschema.validate(json.loads(c.text),
                                                                  SCHEMA) is None
        with pytest.raises(ValueError, match="look-around"):
            llm.generate(["d"], _params(StructuredOutputsParams(regex="(?=a)b")),
                         use_tqdm=False)
    finally:
        core.structured.shutdown()
        core.structured.manager = xgrammar_manager


def test_structural_tags_in_both_forms_compile(llm):
    body = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    legacy = {"type": "structural_tag", "triggers": ["<f>"], "structures": [
        {"begin": "<f>", "schema": body, "end": "</f>"}]}
    current = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": body},
        "end": "</f>"}}
    manager = llm.llm_engine.core.structured.manager
    for tag in (legacy, current):
        manager.validate(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    with pytest.raises(ValueError, match="structural_tag"):
        manager.validate(StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'))
    out = llm.generate(["k"], _params(StructuredOutputsParams(structural_tag=json.dumps(current)),
                                      max_tokens=60), use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":  # the tag's content is the JSON object between its marks
        assert out.text.startswith("<f>") and out.text.endswith("</f>")
        jsonschema.validate(json.loads(out.text[3:-4]), body)


def test_constrained_rows_beside_speculating_rows(smollm_gguf):
    """Speculative decoding in the same steps as structured requests, drafts accepted at a
    forced rate: the constrained rows' drafts are accepted only where their grammar allows
    them, so every answer keeps its grammar."""
    llm = LLM(**DUMMY,
              max_num_seqs=16, speculative_config={
                  "method": "test_forced_acceptance", "num_speculative_tokens": 3,
                  "acceptance_rate": 0.5})
    runner = llm.llm_engine.core.runner
    verify_steps = []
    plain_sample = runner.sample

    def counted_sample(handle, grammar):
        if handle.inputs is not None and handle.inputs.has_drafts:
            verify_steps.append(grammar is not None)
        return plain_sample(handle, grammar)

    runner.sample = counted_sample
    try:
        choices = ["alpha", "beta gamma"]
        params = [_params(StructuredOutputsParams(choice=choices), seed=i) for i in range(4)]
        params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4
        outs = llm.generate(["a"] * 8, params, use_tqdm=False)
        for o in outs[:4]:
            assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop"
        for o in outs[4:]:
            assert len(o.outputs[0].token_ids) == 24
        assert any(verify_steps)  # drafts were verified in steps with constrained rows
    finally:
        llm.shutdown()


def test_logits_padded_past_the_tokenizer_with_eos_beyond_it(smollm_gguf, tmp_path):
    """A model whose vocabulary is padded past its tokenizer's and whose end-of-sequence id
    lies in the padding (the H200 benchmark's Qwen3 shape with SmolLM2's tokenizer): the
    grammar covers the tokenizer's ids and the eos id, so a finished answer stops."""
    import json

    from shoal.loader.tokenizers import load_tokenizer

    n = len(load_tokenizer("smollm2"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": n + 96, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "bos_token_id": 1, "eos_token_id": n + 40, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    padded = LLM(model=str(tmp_path), tokenizer="smollm2", load_format="dummy",
                 max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_seqs=8)
    try:
        assert padded.llm_engine.core.structured.manager.vocab_size == n + 41
        so = StructuredOutputsParams(choice=["yes", "no"])
        outs = padded.generate(["a", "b", "c"], _params(so, ignore_eos=True, max_tokens=40),
                               use_tqdm=False)
        for o in outs:
            assert o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop"
    finally:
        padded.shutdown()


def test_async_scheduling_pipelines_constrained_steps(llm, smollm_gguf):
    """With async scheduling constrained requests no longer run the loop one step at a time:
    a pipelined step's forward runs while the step before's tokens are applied (grammars
    advanced), then its bitmask is filled and it samples. Output is the one-step-at-a-time
    engine's, seeded sampling included; grammars that end while the others go on leave
    their rows allowed-all (the token is dropped)."""
    pipe = LLM(**DUMMY,
               max_num_seqs=16, async_scheduling=True)
    try:
        core = pipe.llm_engine.core
        inflight_at_launch = []
        finished_since: dict[int, int] = {}  # executed step -> steps finished since
        runner = core.runner
        execute, sample, finish = runner.execute, runner.sample, runner.finish

        def counting(sched):
            handle = execute(sched)
            if not sched.is_empty:  # (the step itself is in the queue already)
                inflight_at_launch.append(len(core.queue) > 1)
                finished_since[id(handle)] = 0
            return handle

        def counting_finish(handle):
            for h in finished_since:
                finished_since[h] += 1
            return finish(handle)
        deferred = []

        def counting_sample(handle, grammar):
            # Deferred: sampled after the step ahead of it was finished.
            deferred.append(finished_since.pop(id(handle), 0) > 0)
            sample(handle, grammar)
        runner.execute, runner.sample, runner.finish = counting, counting_sample, counting_finish
        so_json = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        so_choice = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
        so_regex = StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}")
        params = ([_params(so_json, seed=i) for i in range(4)]
                  + [_params(so_choice, seed=i) for i in range(3)]
                  + [_params(so_regex, seed=i) for i in range(3)]
                  + [SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True)])
        prompts = [f"q{i}" for i in range(len(params))]
        got = pipe.generate(prompts, params, use_tqdm=False)
        want = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want]
        for o in got[4:7]:
            assert o.outputs[0].text in ("yes", "no", "maybe so")
        assert sum(inflight_at_launch) >= len(inflight_at_launch) // 2, inflight_at_launch
        assert sum(deferred) >= len(inflight_at_launch) // 2, deferred
        assert not core.has_unfinished_requests()
    finally:
        pipe.shutdown()


class _ReferenceDrafts(HostDrafter):
    """Drafts k tokens of a known continuation per prompt: the first `right` as they are,
    the rest replaced by arbitrary ids (which the grammar mostly refuses)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int = 3):
        import random

        self.refs, self.k, self.rng = refs, k, random.Random(4)
        self.proposed = 0

    def draft(self, prompt, output) -> list[int]:
        ref = self.refs.get(tuple(prompt))
        if ref is None or len(output) >= len(ref):
            return []
        drafts = list(ref[len(output):len(output) + self.k])
        right = self.rng.randrange(len(drafts) + 1)
        self.proposed += len(drafts)
        return [t if j < right else (t * 7 + 11) % 49152 for j, t in enumerate(drafts)]


def test_speculative_decoding_drafts_are_checked_by_the_grammar(llm):
    """Constrained requests take drafts: each verify row is masked as if the drafts before it
    were accepted, so a draft the grammar refuses is rejected there and greedy output is the
    plain engine's token for token (JSON, choice and regex), some drafts accepted; sampled
    output stays valid JSON; the matchers end where the output ends (walking the drafts left
    them rolled back)."""
    spec = LLM(**DUMMY,
               max_num_seqs=16, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 3})
    try:
        so_json = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        so_choice = StructuredOutputsParams(choice=["alpha", "beta gamma", "yes"])
        so_regex = StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}")
        greedy = ([_params(so_json, temperature=0)] * 3 + [_params(so_choice, temperature=0)]
                  + [_params(so_regex, temperature=0)] * 2)
        prompts = [{"prompt_token_ids": [17 + i, 400 + 3 * i, 9]} for i in range(len(greedy))]
        want = llm.generate(prompts, greedy, use_tqdm=False)
        proposer = _ReferenceDrafts({tuple(p["prompt_token_ids"]): list(o.outputs[0].token_ids)
                                     for p, o in zip(prompts, want)})
        core = spec.llm_engine.core
        core.runner.drafter = proposer
        accepted = [0]
        stats = core.scheduler.stats

        def counting():
            s = stats()
            accepted[0] += s.spec_num_accepted_tokens
            return s
        core.scheduler.stats = counting
        got = spec.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want]
        assert proposer.proposed > 0 and 0 < accepted[0] < proposer.proposed
        for o in got[:3]:
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        # Sampled: drafts from the greedy answers, mostly wrong for these seeds; every
        # answer that completes is valid.
        sampled = spec.generate(prompts[:3], [_params(so_json, seed=i) for i in range(3)],
                                use_tqdm=False)
        for o in sampled:
            assert o.outputs[0].finish_reason in ("stop", "length")
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert not core.has_unfinished_requests()
    finally:
        spec.shutdown()
