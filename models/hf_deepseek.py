"""DeepSeek-V3's ``transformers`` config (``model_type`` ``deepseek_v3``) to and from :class:`ModelConfig`
(the weights' names: :mod:`models.hf`). YaRN rope scaling (the published 128k config) scales the rotary
frequencies and, through ``mscale_all_dim``, the softmax (:mod:`parallel.layers.mla`); multi-token
prediction layers are not built either: a config that has them imports with a warning (HF's
``DeepseekV3ForCausalLM`` does not run them either, and the ``model.layers.<n_layers>.*`` weights
are not read)."""

from __future__ import annotations

import warnings
from typing import Mapping

from .config import ModelConfig, ModelConfigError
from .hf_config import hf_rope_parameters, llama_shape_fields, rope_fields

#: aux-loss-free balancing's bias step on import (DeepSeek-V3's γ for most of its pre-training)
DEEPSEEK_BIAS_UPDATE_RATE = 1e-3


def deepseek_config(c: Mapping) -> ModelConfig:
    """A DeepSeek-V3 ``config.json`` dict as a :class:`ModelConfig`."""
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
    if mtp:
        warnings.warn(
            f"DeepSeek-V3 num_nextn_predict_layers={mtp}: the multi-token prediction layers are ignored "
            f"(not built; HF's DeepseekV3ForCausalLM does not run them either)",
            stacklevel=3,
        )
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **llama_shape_fields(c),
        qkv_bias=bias,
        o_bias=bias,
        **rope_fields(c),
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c.get("q_lora_rank") or 0,
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        rope_interleave=bool(c.get("rope_interleave", True)),
        moe_experts=c["n_routed_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"],
        moe_shared_experts=c.get("n_shared_experts") or 0,
        moe_first_dense=c.get("first_k_dense_replace") or 0,
        moe_normalize_top_k=bool(c.get("norm_topk_prob", True)),
        moe_score="sigmoid",
        moe_groups=c.get("n_group") or 1,
        moe_topk_groups=c.get("topk_group") or 1,
        moe_routed_scale=float(c.get("routed_scaling_factor", 1.0)),
        moe_aux_loss_weight=0.0,
        moe_bias_update_rate=DEEPSEEK_BIAS_UPDATE_RATE,
    )


def deepseek_config_dict(cfg: ModelConfig) -> dict:
    """The DeepSeek-V3 ``config.json`` of ``cfg`` (inverse of :func:`deepseek_config`)."""
    if not (cfg.moe_experts and cfg.moe_score == "sigmoid" and cfg.moe_every == 1 and cfg.moe_shared_experts):
        raise ModelConfigError(
            "DeepSeek-V3 export needs sigmoid-routed experts in every layer from moe_first_dense on, with shared "
            f"experts (moe_experts={cfg.moe_experts}, moe_score={cfg.moe_score!r}, moe_every={cfg.moe_every}, "
            f"moe_shared_experts={cfg.moe_shared_experts})"
        )
    if cfg.bias("qkv") != cfg.bias("o") or cfg.bias("mlp"):
        raise ModelConfigError("DeepSeek-V3 export: attention_bias covers q, kv and o alike; no MLP bias")
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias("qkv"),
        "hidden_act": "silu",
        "rope_parameters": hf_rope_parameters(cfg),
        "rope_interleave": cfg.rope_interleave,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.moe_d_ff or cfg.d_ff,
        "n_shared_experts": cfg.moe_shared_experts,
        "first_k_dense_replace": cfg.moe_first_dense,
        "norm_topk_prob": cfg.moe_normalize_top_k,
        "n_group": cfg.moe_groups,
        "topk_group": cfg.moe_topk_groups,
        "routed_scaling_factor": cfg.moe_routed_scale,
        "num_nextn_predict_layers": 0,
    }
