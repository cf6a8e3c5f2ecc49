"""The compatibility table (shoal/engine/compatibility.py): every row has a configuration that
falls on it and says so in its own words, a plain configuration falls on none, and
create_engine_config names every row a configuration falls on in one ValueError."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal.engine.compatibility import ROWS, ResolvedArgs, check_compatibility, violations
from shoal.engine.engine_args import EngineArgs


def _hf(**extra):
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                max_position_embeddings=128, num_hidden_layers=2)
    return SimpleNamespace(**{**base, **extra})


_SPEC = {"method": "ngram", "num_speculative_tokens": 2}
_EAGLE3 = {"method": "eagle3", "model": "/tmp/eagle3", "num_speculative_tokens": 2}
_DRAFT_MODEL = {"method": "draft_model", "model": "/tmp/draft", "num_speculative_tokens": 2}
_EAGLE = {"method": "eagle", "model": "/tmp/eagle", "num_speculative_tokens": 2}
_DP_EP = dict(data_parallel_size=2, enable_expert_parallel=True, data_parallel_rank=0,
              data_parallel_master_port=1234)
BERT = dict(architectures=["BertModel"], model_type="bert")
_V4 = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", index_topk=512)
_MTP = {"method": "mtp", "num_speculative_tokens": 1}
_HYBRID = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
               layer_types=["linear_attention", "full_attention"])

# (engine arguments, model config fields, runner, device, max_model_len, a row's message)
CASES = [
    (dict(runner="generate"), BERT, "pooling", "cpu", 64, "it is a pooling model"),
    (dict(runner="generate", convert="embed"), {}, "pooling", "cpu", 64,
     "runner='generate' cannot run convert='embed'"),
    (dict(pipeline_parallel_size=2), BERT, "pooling", "cpu", 64,
     "BertModel is an encoder-only model, which runs in one stage: use tensor_parallel_size"),
    (_DP_EP, {}, "pooling", "cpu", 64, "pooling runner does not support enable_expert_parallel"),
    (dict(speculative_config=_SPEC), {}, "pooling", "cpu", 64,
     "speculative_config applies to generation, not the pooling runner"),
    (dict(enable_lora=True), {}, "pooling", "cpu", 64,
     "the pooling runner takes no adapters yet"),
    (dict(enable_lora=True), dict(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=32),
     "generate", "cpu", 64, "enable_lora is not supported for DeepseekV3ForCausalLM yet"),
    (dict(), dict(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=32), "pooling", "cpu",
     64, r"runner=.pooling. is not supported for DeepseekV3ForCausalLM \(latent attention, MLA\)"),
    (dict(), dict(sliding_window=32), "pooling", "cpu", 64,
     r"max_model_len \(64\) is longer than the model's sliding window \(32\), which pooling "
     "does not apply yet"),
    (dict(speculative_config=_DRAFT_MODEL), dict(sliding_window=32), "generate", "cpu", 64,
     r"a drafter with a KV cache of its own follows the target's block tables, which a model "
     r"whose every layer has a sliding window \(32\) empties"),
    (dict(), _HYBRID, "pooling", "cpu", 64,
     r"runner=.pooling. is not supported for Qwen3NextForCausalLM \(linear-attention layers\)"),
    (dict(speculative_config=_EAGLE), _HYBRID, "generate", "cpu", 64,
     "method 'eagle' has no head for Qwen3NextForCausalLM"),
    (dict(kv_offloading_size=1.0, tensor_parallel_size=2), {}, "generate", "cpu", 64,
     "kv_offloading_size does not support tensor_parallel_size > 1 yet"),
    (dict(kv_offloading_size=1.0, pipeline_parallel_size=2), {}, "generate", "cpu", 64,
     "kv_offloading_size does not support pipeline_parallel_size > 1 yet"),
    (dict(kv_offloading_size=1.0, data_parallel_size=2), {}, "generate", "cpu", 64,
     "kv_offloading_size does not support data_parallel_size > 1 yet"),
    (dict(data_parallel_size=2), {}, "generate", "cpu", 64,
     "data_parallel_size > 1 runs replicas behind `shoal serve`"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), {}, "generate", "cpu", 64,
     "kv_offloading_size needs enable_prefix_caching"),
    (dict(kv_offloading_disk_path="/tmp/x"), {}, "generate", "cpu", 64,
     "the disk KV tier sits below the CPU tier"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_size=1.0), {}, "generate", "cpu", 64,
     "kv_offloading_disk_size needs kv_offloading_disk_path"),
    (dict(async_scheduling=True, tensor_parallel_size=2), {}, "generate", "cpu", 64,
     "async_scheduling does not support tensor_parallel_size > 1"),
    (dict(async_scheduling=True, pipeline_parallel_size=2), {}, "generate", "cpu", 64,
     "async_scheduling does not support pipeline_parallel_size > 1"),
    (dict(async_scheduling=True, **_DP_EP), {}, "generate", "cpu", 64,
     "async_scheduling does not support enable_expert_parallel"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), {}, "generate", "cpu",
     64, "tensor_parallel_size 2 needs 'mp' or 'ray'"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), {}, "generate", "cpu",
     64, "pipeline_parallel_size 2 needs distributed_executor_backend 'mp' or 'ray'"),
    (dict(pipeline_parallel_size=2), {}, "generate", "cuda", 64,
     "does not support CUDA graphs yet: pass enforce_eager"),
    (dict(pipeline_parallel_size=2), dict(architectures=["Qwen3MoeForCausalLM"]), "generate",
     "cpu", 64, "not Qwen3MoeForCausalLM yet"),
    (dict(pipeline_parallel_size=4), {}, "generate", "cpu", 64,
     r"pipeline_parallel_size 4 needs at least as many decoder layers \(the model has 2\)"),
    (dict(_DP_EP, tensor_parallel_size=2), {}, "generate", "cpu", 64,
     "needs tensor_parallel_size 1 and pipeline_parallel_size 1"),
    (dict(_DP_EP, distributed_executor_backend="mp"), {}, "generate", "cpu", 64,
     "distributed_executor_backend must be unset or 'uni'"),
    (dict(_DP_EP, data_parallel_rank=2), {}, "generate", "cpu", 64,
     r"needs data_parallel_rank in \[0, 2\)"),
    (dict(_DP_EP, model_impl="transformers"), {}, "generate", "cpu", 64,
     "the Transformers backend runs transformers' own MoE layers"),
    (dict(model_impl="transformers", speculative_config=_EAGLE), {}, "generate", "cpu", 64,
     "method 'eagle' drafts from a shoal model class's layers"),
    (dict(model_impl="transformers", pipeline_parallel_size=2), {}, "generate", "cpu", 64,
     "LlamaForCausalLM with pipeline_parallel_size 2: its config has no base_model_pp_plan"),
    (dict(model_impl="transformers", tensor_parallel_size=2), {}, "generate", "cpu", 64,
     "LlamaForCausalLM with tensor_parallel_size 2: its config has no base_model_tp_plan"),
    (dict(cpu_int4_matmul=True), {}, "generate", "cuda", 64,
     r"cpu_int4_matmul runs on the CPU only \(device is cuda\)"),
    (dict(speculative_config=_EAGLE), _V4, "generate", "cpu", 64,
     "method 'eagle' has no head for DeepseekV4ForCausalLM"),
    (dict(kv_cache_dtype="fp8", block_size=6), _V4, "generate", "cuda", 64,
     r"needs block_size a multiple of 4 \(got 6\)"),
    (dict(speculative_config=_SPEC),
     dict(architectures=["Qwen2_5_VLForConditionalGeneration"], multimodal_config=object()),
     "generate", "cpu", 64, r"speculative decoding with Qwen2_5_VLForConditionalGeneration "
     r"\(images in\) is not supported yet"),
]


def _resolved(kwargs, hf_extra, runner, device, max_len) -> ResolvedArgs:
    return ResolvedArgs(EngineArgs(**kwargs), runner, device, max_len, _hf(**hf_extra))


@pytest.mark.parametrize("kwargs, hf_extra, runner, device, max_len, message", CASES)
def test_each_row_says_what_it_refuses(kwargs, hf_extra, runner, device, max_len, message):
    with pytest.raises(ValueError, match=message):
        check_compatibility(_resolved(kwargs, hf_extra, runner, device, max_len))


def test_every_row_has_a_case():
    hit = {id(row) for case in CASES for row in violations(_resolved(*case[:5]))}
    missing = [f"{row.setting} x {row.other}" for row in ROWS if id(row) not in hit]
    assert not missing, f"rows no case falls on: {missing}"


@pytest.mark.parametrize("runner, device", [("generate", "cpu"), ("generate", "cuda"),
                                            ("pooling", "cpu")])
def test_plain_configurations_fall_on_no_row(runner, device):
    assert violations(_resolved({}, {}, runner, device, 64)) == []
    # supported combinations stay allowed
    for kwargs in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2, enforce_eager=True),
                   dict(enable_lora=True, pipeline_parallel_size=2, enforce_eager=True),
                   dict(tensor_parallel_size=2, speculative_config=_EAGLE),
                   dict(pipeline_parallel_size=2, enforce_eager=True, speculative_config=_EAGLE3),
                   dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x",
                        kv_offloading_disk_size=1.0), _DP_EP,
                   dict(_DP_EP, speculative_config=_SPEC)):
        if runner == "generate":
            assert violations(_resolved(kwargs, {}, runner, device, 64)) == [], kwargs
    if runner == "pooling":  # every rank a pooling runner (pooling/test_pooling_tensor_parallel,
        # a decoder's stages: pooling/test_pooling_pipeline_parallel)
        for kwargs in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                       dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
            assert violations(_resolved(kwargs, {}, runner, device, 64)) == [], kwargs
        classifier = dict(architectures=["LlamaForSequenceClassification"])
        assert violations(_resolved(dict(pipeline_parallel_size=2), classifier, runner,
                                    device, 64)) == []
    # a replica of `shoal serve --data-parallel-size 2`
    served = ResolvedArgs(EngineArgs(data_parallel_size=2), runner, device, 64, _hf(),
                          serving=True)
    assert violations(served) == []


def test_deepseek_v32_takes_an_fp8_cache_on_either_backend():
    """kv_cache_dtype='fp8' for V3.2 (block-scaled FP8 indexer keys) on CUDA's default
    Triton backend, the torch backend, and the CPU: no row refuses it
    (attention/test_mla_sparse.py runs the Triton path against the torch one)."""
    v32 = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
               kv_lora_rank=32, index_topk=32)
    for device, backend in (("cuda", None), ("cuda", "triton"), ("cuda", "torch"),
                            ("cpu", None), ("cpu", "triton")):
        kwargs = dict(kv_cache_dtype="fp8", attention_backend=backend)
        assert violations(_resolved(kwargs, v32, "generate", device, 64)) == [], (device,
                                                                                  backend)


def test_create_engine_config_names_every_row_it_falls_on():
    args = EngineArgs(device="cpu", tensor_parallel_size=2, speculative_config=_SPEC,
                      kv_offloading_size=1.0, async_scheduling=True)
    with pytest.raises(ValueError) as e:
        args.create_engine_config(_hf())
    text = str(e.value)
    assert text.startswith("these engine settings do not work together:")
    for part in ("kv_offloading_size does not support tensor_parallel_size",
                 "async_scheduling does not support tensor_parallel_size"):
        assert part in text


def test_value_checks_come_before_the_table():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineArgs(device="cpu", pipeline_parallel_size=0,
                   kv_offloading_size=1.0).create_engine_config(_hf())
    assert EngineArgs(device="cpu").create_engine_config(_hf()).parallel_config.world_size == 1


def test_sliding_window_rows_read_each_layers_window():
    """The rows read the windows the model's layers apply (config.layer_types): a config
    with a window no layer uses is plain, and a hybrid model (full-attention layers beside
    sliding ones) drafts over its full-attention group's tables."""
    unused = dict(sliding_window=32, layer_types=["full_attention"] * 2)
    assert violations(_resolved({}, unused, "pooling", "cpu", 64)) == []
    hybrid = dict(sliding_window=32, layer_types=["full_attention", "sliding_attention"])
    assert violations(_resolved(dict(speculative_config=_DRAFT_MODEL), hybrid, "generate",
                                "cpu", 64)) == []
    assert [r.other for r in violations(_resolved({}, hybrid, "pooling", "cpu", 64))] == [
        "a sliding window shorter than max_model_len"]


def test_deepseek_v4_keeps_cuda_graphs_and_eager_only_classes_run_eagerly(caplog,
                                                                          monkeypatch):
    """No row refuses DeepSeek-V4 on CUDA, and it keeps CUDA graphs (its decode steps are
    captured: decode_graphs_only). A class that cannot be captured at all (eager_only_reason)
    runs eagerly with one log line saying why; a model with graphs keeps them, and on the CPU
    nothing is said."""
    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM

    assert violations(_resolved({}, _V4, "generate", "cuda", 64)) == []
    # DP+EP, with MTP too (models/test_deepseek_v4_data_parallel.py)
    assert violations(_resolved(dict(_DP_EP, speculative_config=_MTP), _V4, "generate", "cpu",
                                64)) == []
    with caplog.at_level("INFO", logger="shoal.engine.graph_support"):
        assert not EngineArgs(device="cuda").create_engine_config(_hf(**_V4)).enforce_eager
    assert [r.getMessage() for r in caplog.records
            if r.name == "shoal.engine.graph_support"] == [
        "DeepseekV4ForCausalLM: CUDA graphs of decode steps only: its attention "
        "(shoal/layers/compressed_attention.py) reads a prefill chunk's or a verify step's "
        "request spans on the host; a step of decodes alone reads none"]
    caplog.clear()
    monkeypatch.setattr(DeepseekV4ForCausalLM, "eager_only_reason", "its forward reads the "
                        "host", raising=False)
    with caplog.at_level("INFO", logger="shoal.engine.graph_support"):
        assert EngineArgs(device="cuda").create_engine_config(_hf(**_V4)).enforce_eager
        assert not EngineArgs(device="cuda").create_engine_config(_hf()).enforce_eager
        assert not EngineArgs(device="cpu").create_engine_config(_hf(**_V4)).enforce_eager
    said = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert said == ["DeepseekV4ForCausalLM runs without CUDA graphs (enforce_eager): its "
                    "forward reads the host"]
