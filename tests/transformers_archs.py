"""The decoder architectures the Transformers backend is tested on (transformers 5.25, tiny
random configs: hidden 64, 2 layers, fp32): what each needs beyond tests/oracle.py's
TINY_COMMON, and what is expected of it. tests/models/test_transformers_backend.py runs
them; benchmarks/architectures_table.py prints them as a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# one sliding-window layer, then a full one; windows shorter than the test prompts
_SWA = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_DS_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)


@dataclass(frozen=True)
class Arch:
    """One tested configuration. refused: words of the ValueError it gets at start-up (the
    backend cannot run it); xfail: why it runs but does not match transformers yet;
    native_xfail: why shoal's own class (which transformers' class it maps to has one) does
    not run it yet."""

    name: str  # test id (the model_type, or model_type-variant)
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    xfail: str | None = None
    native_xfail: str | None = None

    @property
    def passes(self) -> bool:
        return self.refused is None and self.xfail is None


def _a(model_type: str, name: str | None = None, **fields: Any) -> Arch:
    return Arch(name or model_type, model_type, fields)


def _refused(model_type: str, reason: str, name: str | None = None, **fields: Any) -> Arch:
    return Arch(name or model_type, model_type, fields, refused=reason)


ARCHS: list[Arch] = [
    # shoal has its own class for these: the backend must give the class's tokens too
    _a("llama"),
    _a("llama", "llama-tied", tie_word_embeddings=True),
    _a("mistral", sliding_window=8),
    _a("qwen2"),
    _a("qwen3", head_dim=16),
    _a("qwen3_moe", head_dim=16, **_QWEN_MOE),
    _a("gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
       intermediate_size=32, **_SWA),  # attention sinks (s_aux)
    # dense
    _a("gemma", head_dim=16),
    _a("gemma2", "gemma2-no-softcap", head_dim=16, attn_logit_softcapping=None, **_SWA),
    _a("gemma3_text", head_dim=16, **_SWA),
    _a("gemma3n_text", head_dim=16, num_kv_shared_layers=0, altup_num_inputs=2,
       laurel_rank=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
       activation_sparsity_pattern=[0.0, 0.0], intermediate_size=[128, 128], **_SWA),
    _a("vaultgemma", "vaultgemma-no-softcap", head_dim=16, attn_logit_softcapping=None,
       **_SWA),
    # attention logit soft-capping (torch and Triton backends): gemma2's own cap (50), and a cap of 2
    # that bends every score of the tiny model
    _a("gemma2", head_dim=16, **_SWA),
    _a("vaultgemma", head_dim=16, attn_logit_softcapping=2.0, **_SWA),
    _a("phi"),
    _a("phi3", pad_token_id=0),
    _a("starcoder2"),
    _a("olmo"),
    _a("olmo2"),
    _a("olmo3", **_SWA),
    _a("cohere"),
    _a("cohere2", **_SWA),
    _a("granite"),
    _a("gpt_neox"),
    _a("gptj", rotary_dim=16),
    _a("codegen", rotary_dim=8),
    _a("gpt2"),
    _a("gpt_bigcode"),
    _a("opt"),
    _a("persimmon"),
    _a("bitnet"),
    _a("smollm3", pad_token_id=0),
    _a("glm", pad_token_id=0),
    _a("glm4", pad_token_id=0),
    _a("helium", head_dim=16),
    Arch("exaone", "exaone", native_xfail=(
        "its checkpoints keep EXAONE 3's tensor names (transformer.h.N.attn.attention.*), which "
        "transformers renames for its Llama class and shoal's LlamaForCausalLM does not (real "
        "EXAONE 3 configs name ExaoneForCausalLM, which takes the backend under auto)")),
    _a("exaone4", **_SWA),
    _a("ministral", head_dim=16, **_SWA),
    _a("ministral3", head_dim=16),
    _a("nemotron"),
    _a("arcee"),
    _a("seed_oss"),
    _a("hunyuan_v1_dense", head_dim=16),
    _a("apertus"),
    _a("ernie4_5"),
    _a("internlm3"),
    _a("cwm"),
    _a("nanochat"),
    _a("lfm2", name="lfm2-attention-only"),  # LFM2 with attention layers only
    # mixture of experts
    _a("mixtral", **_MOE),
    _a("qwen2_moe", shared_expert_intermediate_size=32, **_QWEN_MOE),
    _a("olmoe", num_experts=4, num_experts_per_tok=2),
    _a("flex_olmo", num_experts=4, num_experts_per_tok=2, pad_token_id=0),
    _a("granitemoe", **_MOE),
    _a("phimoe", **_MOE),
    _a("jetmoe"),
    _a("dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=512,
       attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
       ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    _a("glm4_moe", head_dim=16, pad_token_id=0, **_DS_MOE),
    _a("dots1", head_dim=16, **_DS_MOE),
    _a("hunyuan_v1_moe", head_dim=16, num_experts=4, moe_topk=2, moe_intermediate_size=32),
    _a("ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    _a("minimax_m2", head_dim=16, **_MOE),
    _a("afmoe", head_dim=16, **_QWEN_MOE),
    _a("exaone_moe", head_dim=16, **_QWEN_MOE),
    # refused at start-up, with the reason
    _refused("stablelm", "_supports_attention_backend is False"),
    _refused("falcon", "_supports_attention_backend is False"),
    _refused("bloom", "_supports_attention_backend is False"),
    _refused("mpt", "_supports_attention_backend is False"),
    _refused("qwen3_next", "_supports_attention_backend is False", head_dim=16),
    # BartConfig is encoder-decoder; the checkpoint of BartForCausalLM (its decoder alone)
    # is refused for its modeling code
    _refused("bart", "encoder-decoder|_supports_attention_backend is False"),
    _refused("deepseek_v3", "latent attention", head_dim=16, kv_lora_rank=32,
             q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
             **_DS_MOE),
    _refused("llama4_text", "'chunked_attention'", head_dim=16),
    _refused("lfm2", "'conv'", layer_types=["conv", "full_attention"]),
    _refused("granitemoehybrid", "'linear_attention'", layer_types=["mamba", "attention"],
             **_MOE),
    _refused("recurrent_gemma", "'linear_attention'", block_types=["recurrent", "attention"]),
    _refused("doge", "masks of their own"),
    _refused("diffllama", "more than once per pass"),
]
