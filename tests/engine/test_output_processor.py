"""OutputProcessor: final-only requests are detokenized once, others token by token, with the
same text; every request's outputs reach its consumer."""

from __future__ import annotations

import pytest

from shoal.core.types import EngineCoreOutput
from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.input_processor import InputProcessor
from shoal.engine.output_processor import OutputKind, OutputProcessor
from shoal.engine.request_checks import EngineLimits
from shoal.sampling_params import SamplingParams

TOKENS = [[1000 + 37 * i % 5000] for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    from shoal.loader import load_frontend_tokenizer

    return load_frontend_tokenizer(None)


def _run(tokenizer, kind: OutputKind, stop: list[str] | None = None):
    limits = EngineLimits(vocab_size=49152, max_model_len=512, num_kv_blocks=64, block_size=16,
                          max_num_seqs=4)
    req = InputProcessor(tokenizer, limits).process_request(
        "r", [1, 2, 3], SamplingParams(max_tokens=len(TOKENS), stop=stop))
    outs = OutputProcessor(tokenizer)
    delivered = []
    outs.add_request(req, kind, delivered.append)
    for i, t in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        outs.process_outputs([EngineCoreOutput("r", t, finish_reason="length" if last else None)])
        if delivered and delivered[-1].finished:
            break
    return delivered


def _streamed_text(tokenizer) -> str:
    return "".join(o.outputs[0].text for o in _run(tokenizer, OutputKind.DELTA) if o.outputs)


@pytest.fixture
def update_calls(monkeypatch) -> list[int]:
    """The number of token ids of each IncrementalDetokenizer.update call (clear it to start
    counting afresh)."""
    calls: list[int] = []
    real = IncrementalDetokenizer.update

    def counting(self, ids, stop_terminated=False):
        calls.append(len(ids))
        return real(self, ids, stop_terminated)

    monkeypatch.setattr(IncrementalDetokenizer, "update", counting)
    return calls


def test_final_only_is_decoded_once_with_the_same_text(tokenizer, update_calls):
    streamed = _streamed_text(tokenizer)
    update_calls.clear()
    (final,) = _run(tokenizer, OutputKind.FINAL_ONLY)
    assert final.finished and final.outputs[0].text == streamed
    assert update_calls == [len(TOKENS)]  # one decode of every token, at the end


def test_stop_strings_still_need_token_by_token_decoding(tokenizer, update_calls):
    full = _streamed_text(tokenizer)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    update_calls.clear()
    (final,) = _run(tokenizer, OutputKind.FINAL_ONLY, stop=[stop])
    c = final.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:full.index(stop)]
    assert len(update_calls) > 1 and set(update_calls) == {1}


def test_metrics_count_each_of_n_samples_and_the_request_once(tokenizer):
    # vLLM's counting: every sample is a finished request (success, prompt and generation
    # tokens, latencies); n and the longest sample's length once per request
    from shoal.metrics import IterationStats

    limits = EngineLimits(vocab_size=49152, max_model_len=512, num_kv_blocks=64, block_size=16,
                          max_num_seqs=4)
    req = InputProcessor(tokenizer, limits).process_request(
        "r", [1, 2, 3], SamplingParams(n=3, max_tokens=4, temperature=1.0))
    outs = OutputProcessor(tokenizer)
    outs.add_request(req, OutputKind.FINAL_ONLY)
    ids = [c.request_id for c in req.core_requests]
    it = IterationStats()
    outs.process_outputs([EngineCoreOutput(ids[0], [7], queue_time=0.0),
                          EngineCoreOutput(ids[1], [8, 9], finish_reason="stop",
                                           queue_time=0.0)], it)
    assert [f.finish_reason for f in it.finished] == ["stop"] and not it.finished_parents
    assert it.finished[0].num_generation_tokens == 2
    it = IterationStats()
    outs.process_outputs([EngineCoreOutput(ids[0], [7, 7, 7], finish_reason="length")], it)
    assert [f.num_generation_tokens for f in it.finished] == [4]
    assert not it.finished_parents  # the third sample is still running
    it = IterationStats()
    outs.abort("r", it)
    assert [(f.finish_reason, f.num_prompt_tokens) for f in it.finished] == [("abort", 3)]
    assert [(p.n, p.max_num_generation_tokens) for p in it.finished_parents] == [(3, 4)]
    req = InputProcessor(tokenizer, limits).process_request(
        "s", [1, 2], SamplingParams(n=2, max_tokens=4, temperature=1.0))
    outs.add_request(req, OutputKind.FINAL_ONLY)
    it = IterationStats()
    outs.process_outputs([EngineCoreOutput(c.request_id, [5], finish_reason="stop")
                          for c in req.core_requests], it)
    assert len(it.finished) == 2 and [(p.n, p.max_num_generation_tokens)
                                      for p in it.finished_parents] == [(2, 1)]
    req = InputProcessor(tokenizer, limits).process_request(
        "e", [1, 2], SamplingParams(n=2, max_tokens=4, temperature=1.0))
    outs.add_request(req, OutputKind.FINAL_ONLY)
    a, b = (c.request_id for c in req.core_requests)
    it = IterationStats()
    outs.process_outputs([EngineCoreOutput(a, [], finish_reason="error", error="boom"),
                          EngineCoreOutput(b, [5], finish_reason="length")], it)
    assert [f.finish_reason for f in it.finished] == ["error", "length"]  # each its own
