"""The named model sizes: GPT-2/3, Llama (3.1), Qwen3, Mixtral, DeepSeek-V3 (:func:`preset`)."""

from __future__ import annotations

from .config import ModelConfig, ModelConfigError

LLAMA31_ROPE = dict(
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position=8192,
)
# Llama 3.1 8B; the 70B differs only in its sizes
LLAMA3_8B = ModelConfig(
    arch="llama",
    n_layers=32,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    d_ff=14336,
    vocab_size=128256,
    seq_len=8192,
    tie_embeddings=False,
    rope_theta=500000.0,
    **LLAMA31_ROPE,
)
DEEPSEEK_V3 = ModelConfig(
    arch="llama",
    n_layers=61,
    d_model=7168,
    n_heads=128,
    d_ff=18432,
    vocab_size=129280,
    seq_len=4096,
    tie_embeddings=False,
    norm_eps=1e-6,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    # pre-training as the paper does, at 4k with plain RoPE: the released config's YaRN (factor 40, mscale 1,
    # for 128k) extends the context after it and comes with that checkpoint's config.json on import; to
    # continue at long context set model.rope_type=yarn model.rope_factor=40 model.rope_original_max_position=4096
    # model.rope_mscale=1 model.rope_mscale_all_dim=1 (MLA's softmax scale × yarn_mscale(40)² ≈ 1.87)
    rope_type="default",
    moe_experts=256,
    moe_top_k=8,
    moe_d_ff=2048,
    moe_shared_experts=1,
    moe_first_dense=3,
    moe_score="sigmoid",
    moe_groups=8,
    moe_topk_groups=4,
    moe_routed_scale=2.5,
    moe_aux_loss_weight=0.0,
    moe_bias_update_rate=1e-3,
    moe_seq_aux_loss_weight=1e-4,
)
QWEN3_8B = ModelConfig(
    arch="llama",
    n_layers=36,
    d_model=4096,
    n_heads=32,
    n_kv_heads=8,
    attn_head_dim=128,
    d_ff=12288,
    vocab_size=151936,
    seq_len=32768,
    tie_embeddings=False,
    qk_norm=True,
    norm_eps=1e-6,
    rope_theta=1e6,
)

PRESETS: dict[str, ModelConfig] = {
    # trains on a CPU in minutes on bytes (vocab 256)
    "gpt_tiny": ModelConfig(arch="gpt", n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
    "llama_tiny": ModelConfig(
        arch="llama",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        d_ff=352,
        vocab_size=256,
        seq_len=128,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
    "gpt2": ModelConfig(arch="gpt", n_layers=12, d_model=768, n_heads=12, vocab_size=50257, seq_len=1024),
    "gpt3_175b": ModelConfig(arch="gpt", n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048),
    "llama_7b": ModelConfig(
        arch="llama",
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        vocab_size=32000,
        seq_len=4096,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
    # tests: Mixtral's shape in miniature (odd sizes on purpose)
    "mixtral_tiny": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=48,
        n_heads=4,
        n_kv_heads=2,
        d_ff=40,
        vocab_size=256,
        seq_len=32,
        tie_embeddings=False,
        moe_experts=4,
        moe_top_k=2,
        moe_aux_loss_weight=0.02,
    ),
    # Llama 3.1 (rope scaling to 128k; the published 8B and 70B shapes), Qwen3 dense (QK-norm, head_dim 128)
    "llama3_8b": LLAMA3_8B,
    "llama3_70b": LLAMA3_8B.replace(n_layers=80, d_model=8192, n_heads=64, d_ff=28672),
    "qwen3_tiny": ModelConfig(
        arch="llama",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        attn_head_dim=48,
        d_ff=352,
        vocab_size=256,
        seq_len=128,
        qk_norm=True,
        norm_eps=1e-6,
        rope_theta=1e6,
    ),
    "qwen3_8b": QWEN3_8B,
    "qwen3_30b_a3b": QWEN3_8B.replace(  # Qwen3's MoE: the 8B's heads, vocabulary and norms
        n_layers=48,
        d_model=2048,
        n_kv_heads=4,
        d_ff=6144,
        moe_experts=128,
        moe_top_k=8,
        moe_d_ff=768,
        moe_aux_loss_weight=0.001,
    ),  # fmt: skip
    # Mixtral-8x7B (46.7B parameters, 12.9B active per token); the planner's MoE reference
    "mixtral_8x7b": ModelConfig(
        arch="llama",
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        vocab_size=32000,
        seq_len=4096,
        tie_embeddings=False,
        rope_theta=1e6,
        moe_experts=8,
        moe_top_k=2,
        moe_aux_loss_weight=0.02,
    ),
    # DeepSeek-V3 (671B parameters, 37B active per token), pre-trained at its 4k window with plain RoPE as
    # the paper does (YaRN extends the context afterwards; the plan counts no positional state)
    "deepseek_v3": DEEPSEEK_V3,
    # DeepSeek-V3 in miniature (odd sizes; 6 experts in 3 groups, a dense first layer, q and kv latents), plain
    # rope (YaRN is held against transformers in tests/models/test_hf_deepseek.py)
    "deepseek_tiny": DEEPSEEK_V3.replace(
        n_layers=3,
        d_model=48,
        n_heads=4,
        d_ff=40,
        vocab_size=256,
        seq_len=32,
        kv_lora_rank=24,
        q_lora_rank=20,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        moe_experts=6,
        moe_top_k=3,
        moe_d_ff=12,
        moe_first_dense=1,
        moe_groups=3,
        moe_topk_groups=2,
        moe_seq_aux_loss_weight=0.0,
    ),  # fmt: skip
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named size (``gpt_tiny``, ``llama_tiny``, ``gpt2``, ``gpt3_175b``, ``llama_7b``), optionally changed."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
