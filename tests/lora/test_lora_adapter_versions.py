"""One adapter id and folder whose files are saved again: the prefix cache keys an adapter's
KV blocks by the digest of its files, so new weights under the same id and folder compute
afresh (plain requests, and remove_lora + add_lora), unchanged files, even rewritten, still
hit the cache, a request whose adapter files change before a worker reads them fails alone,
and add_lora of a new version waits for the old version's requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from oracle import write_tiny_checkpoint
from peft_adapters import write_raw_adapter

from shoal import LLM, SamplingParams
from shoal.engine.core import EngineCore
from shoal.lora.adapter import read_adapter, with_content_digest
from shoal.lora.adapter_digest import read_verified
from shoal.lora.request import LoRARequest

STEPS = 6
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**21)
# the tiny Llama's (hidden 64, 2 KV heads of 16) q and v projections
TARGETS = {f"model.layers.{i}.self_attn.{p}": shape for i in range(2)
           for p, shape in (("q_proj", (64, 64)), ("v_proj", (64, 32)))}
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(40)]  # two full blocks of 16


@pytest.fixture
def step_failures(monkeypatch) -> list[Exception]:
    """The errors of steps the engine recovered from; none unless the test empties it."""
    seen: list[Exception] = []
    recover = EngineCore._recover

    def recording(self, error):
        seen.append(error)
        return recover(self, error)

    monkeypatch.setattr(EngineCore, "_recover", recording)
    yield seen
    assert not seen, f"engine steps failed: {seen}"


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[Path, Path, Path]:
    folder = tmp_path_factory.mktemp("lora-versions")
    base = write_tiny_checkpoint(folder / "base", "llama", seed=4)
    a = write_raw_adapter(folder / "a", TARGETS, seed=71, r=4, scale=0.3)
    b = write_raw_adapter(folder / "b", TARGETS, seed=72, r=4, scale=0.3)
    return base, a, b


@pytest.fixture(scope="module")
def llm(family):
    llm = LLM(model=str(family[0]), enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=8, **ENGINE)
    yield llm
    llm.shutdown()


def save_as(src: Path, folder: Path) -> None:
    """`src`'s files written into `folder` anew (new inode times), as a training run's save."""
    folder.mkdir(exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).write_bytes((src / name).read_bytes())


def run(llm: LLM, lora: LoRARequest) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their logprobs and the prompt tokens found in the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0,
                            detokenize=False)
    (out,) = llm.generate([PROMPT], params, lora_request=lora, use_tqdm=False)
    c = out.outputs[0]
    chosen = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
    return list(c.token_ids), chosen, out.num_cached_tokens


def fresh(llm: LLM, adapter: Path, lora_id: int) -> tuple[list[int], list[float]]:
    """What the adapter computes under an id no block was ever keyed by."""
    tokens, logprobs, cached = run(llm, LoRARequest(f"fresh-{lora_id}", lora_id, str(adapter)))
    assert cached == 0
    return tokens, logprobs


def same(x: tuple[list[int], list[float]], y: tuple[list[int], list[float]]) -> bool:
    return x[0] == y[0] and all(abs(p - q) < 1e-4 for p, q in zip(x[1], y[1]))


def test_new_weights_under_one_id_and_folder_compute_afresh(llm, family, tmp_path,
                                                            step_failures):
    _, a, b = family
    want_a, want_b = fresh(llm, a, 80), fresh(llm, b, 81)
    assert not same(want_a, want_b)  # the adapters differ: stale KV would show
    engine, folder = llm.llm_engine, tmp_path / "adapter"
    save_as(a, folder)
    lora = LoRARequest("x", 5, str(folder))
    tokens, logprobs, cached = run(llm, lora)
    assert cached == 0 and same((tokens, logprobs), want_a)
    assert run(llm, lora)[2] == 32  # its two full blocks are cached

    # the files saved again with the same bytes, and registered again: still cache hits
    save_as(a, folder)
    assert engine.remove_lora(5) and engine.add_lora(lora)
    tokens, logprobs, cached = run(llm, lora)
    assert cached == 32 and same((tokens, logprobs), want_a)

    # new weights, same id and folder, a plain request (the worker still holds the old ones)
    save_as(b, folder)
    tokens, logprobs, cached = run(llm, lora)
    assert cached == 0 and same((tokens, logprobs), want_b)
    assert run(llm, lora)[2] == 32

    # back to the old weights through remove_lora + add_lora: computed afresh or found in
    # the blocks computed with those very weights, never with b's
    save_as(a, folder)
    assert engine.remove_lora(5) and engine.add_lora(lora)
    tokens, logprobs, _ = run(llm, lora)
    assert same((tokens, logprobs), want_a)


def test_files_changed_before_the_worker_reads_them_fail_that_request(llm, family, tmp_path,
                                                                     step_failures):
    """The engine core keyed the request's blocks to the files it saw; the worker reads
    other ones before its first step: that request ends with an error naming the change,
    the base request beside it completes, and a new request gets the new weights."""
    _, a, b = family
    folder = tmp_path / "adapter"
    save_as(a, folder)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                            detokenize=False)
    engine.add_request("doomed", {"prompt_token_ids": PROMPT}, params,
                       lora_request=LoRARequest("y", 6, str(folder)))
    engine.add_request("base", {"prompt_token_ids": PROMPT[:10]}, params)
    save_as(b, folder)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["doomed"].outputs[0].finish_reason == "error"
    assert finished["base"].outputs[0].finish_reason == "length"
    assert step_failures and all("changed after the request arrived" in str(e)
                                 for e in step_failures)
    step_failures.clear()
    want_b = fresh(llm, b, 82)
    tokens, logprobs, _ = run(llm, LoRARequest("y", 6, str(folder)))
    assert same((tokens, logprobs), want_b)


def test_add_lora_of_a_new_version_waits_for_the_old_versions_requests(llm, family,
                                                                       tmp_path):
    """Requests of the version held in host memory run on from memory while the files
    change; add_lora of the new version under their id is refused until they end."""
    _, a, b = family
    folder = tmp_path / "adapter"
    save_as(a, folder)
    want_a = fresh(llm, a, 83)
    engine, lora = llm.llm_engine, LoRARequest("z", 7, str(folder))
    assert engine.add_lora(lora)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                            detokenize=False)
    engine.add_request("old", {"prompt_token_ids": PROMPT}, params, lora_request=lora)
    save_as(b, folder)
    with pytest.raises(ValueError, match="saved again"):
        engine.add_lora(lora)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished["old"].outputs[0].token_ids) == want_a[0]
    assert engine.add_lora(lora)  # nothing runs with the old version now


def test_digest_follows_the_bytes(family, tmp_path):
    """The digest changes with the weights or the config, not with a rewrite of the same
    bytes; a worker's read checks the bytes against it."""
    _, a, b = family
    folder = tmp_path / "adapter"
    save_as(a, folder)
    lora = LoRARequest("d", 9, str(folder))
    first = with_content_digest(lora)
    assert first.content_digest == read_adapter(str(a)).digest
    save_as(a, folder)
    assert with_content_digest(lora).content_digest == first.content_digest
    assert first.cache_key != lora.cache_key and first.content_digest in first.cache_key
    save_as(b, folder)
    second = with_content_digest(first)  # (a digest a caller set is replaced)
    assert second.content_digest != first.content_digest
    config = folder / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 8'))
    assert with_content_digest(lora).content_digest not in (first.content_digest,
                                                            second.content_digest)
    with pytest.raises(ValueError, match="changed after the request arrived"):
        read_verified(folder, "adapter_config.json", "adapter_model.safetensors",
                      second.content_digest)
    shutil.rmtree(folder)
    with pytest.raises(ValueError, match="does not exist"):
        with_content_digest(lora)
