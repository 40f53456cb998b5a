"""``transformers`` configs (objects or ``config.json`` dicts) to and from :class:`ModelConfig`:
GPT-2, Llama (3.1+ rope scaling, biases, head_dim), Mixtral, Qwen2, Qwen3 and DeepSeek-V3 (see :mod:`models.hf`)."""

from __future__ import annotations

from typing import Mapping

from parallel.layers.attention import ROPE_TYPES

from .config import ModelConfig, ModelConfigError

LLAMA_LIKE = ("llama", "mixtral", "qwen2", "qwen3", "qwen3_moe")


def rope_fields(c: Mapping) -> dict:
    """Our rotary fields from a ``transformers`` config's ``rope_parameters`` (≥ 5) or ``rope_scaling``."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)), "rope_type": kind}
    if kind == "default":
        return out
    if kind not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if kind == "yarn":
        return out | _yarn_fields(rope, c)
    out["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return out


def _yarn_fields(rope: Mapping, c: Mapping) -> dict:
    """YaRN's fields, with transformers' defaults: the original length is ``max_position_embeddings``, the
    factor their ratio, ``beta_fast`` 32, ``beta_slow`` 1, the range truncated."""
    original = int(rope.get("original_max_position_embeddings") or c["max_position_embeddings"])
    factor = rope.get("factor") or c["max_position_embeddings"] / original
    return dict(
        rope_factor=float(factor),
        rope_original_max_position=original,
        rope_beta_fast=float(rope.get("beta_fast") or 32),
        rope_beta_slow=float(rope.get("beta_slow") or 1),
        rope_mscale=float(rope.get("mscale") or 0),
        rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        rope_attention_factor=float(rope.get("attention_factor") or 0),
        rope_truncate=bool(rope.get("truncate", True)),
    )


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """The ``rope_parameters`` of ``cfg`` (inverse of :func:`rope_fields`)."""
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    if cfg.rope_type == "yarn":
        rope.update(
            original_max_position_embeddings=cfg.rope_original_max_position,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
        )
        optional = {
            "mscale": cfg.rope_mscale,
            "mscale_all_dim": cfg.rope_mscale_all_dim,
            "attention_factor": cfg.rope_attention_factor,
        }
        rope.update({k: v for k, v in optional.items() if v})  # 0: unset
    return rope


def llama_shape_fields(c: Mapping) -> dict:
    """The fields every Llama-shaped ``config.json`` (Llama, Mixtral, Qwen, DeepSeek) gives alike."""
    return dict(
        arch="llama",
        n_layers=c["num_hidden_layers"],
        d_model=c["hidden_size"],
        n_heads=c["num_attention_heads"],
        d_ff=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_len=c["max_position_embeddings"],
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=c.get("tie_word_embeddings", False),
    )


def _llama_like_config(c: Mapping, kind: str) -> ModelConfig:
    """Llama (3.1+ rope scaling, biases, head_dim), Mixtral, Qwen2 (q/k/v biases), Qwen3 (QK-norm)."""
    if c.get("use_sliding_window"):
        raise ModelConfigError(f"{kind} sliding-window attention is not supported (set use_sliding_window=false)")
    attention_bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **llama_shape_fields(c),
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        attn_head_dim=c["head_dim"]
        if c.get("head_dim") not in (None, c["hidden_size"] // c["num_attention_heads"])
        else None,
        qkv_bias=True if kind == "qwen2" else attention_bias,
        o_bias=attention_bias and kind != "qwen2",
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        **rope_fields(c),
    )


def _qwen3_moe_fields(c: Mapping) -> dict:
    dense = sorted(c.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ModelConfigError(f"Qwen3-MoE mlp_only_layers={dense}: only the first layers may be dense")
    return dict(
        moe_experts=c.get("num_experts") or c["num_local_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_d_ff=c["moe_intermediate_size"],
        moe_every=c.get("decoder_sparse_step", 1),
        moe_first_dense=len(dense),
        moe_normalize_top_k=bool(c.get("norm_topk_prob", False)),
        moe_aux_loss_weight=c.get("router_aux_loss_coef", 0.001),
    )


def config_from_hf(hf_config, **overrides) -> ModelConfig:
    """A :class:`ModelConfig` from a ``transformers`` GPT2Config / LlamaConfig (object or dict)."""
    c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    kind = c.get("model_type")
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ModelConfigError(f"GPT-2 activation {c['activation_function']!r} unsupported (tanh GELU only)")
        cfg = ModelConfig(
            arch="gpt",
            n_layers=c["n_layer"],
            d_model=c["n_embd"],
            n_heads=c["n_head"],
            d_ff=c.get("n_inner") or 4 * c["n_embd"],
            vocab_size=c["vocab_size"],
            seq_len=c["n_positions"],
            norm_eps=c.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=c.get("tie_word_embeddings", True),
        )
    elif kind in LLAMA_LIKE:
        cfg = _llama_like_config(c, kind)
        if kind == "mixtral":
            if c.get("sliding_window"):
                raise ModelConfigError(f"Mixtral sliding_window={c['sliding_window']} is not supported (set None)")
            cfg = cfg.replace(
                moe_experts=c["num_local_experts"],
                moe_top_k=c["num_experts_per_tok"],
                moe_aux_loss_weight=c.get("router_aux_loss_coef", 0.001),
            )
        if kind == "qwen3_moe":
            cfg = cfg.replace(**_qwen3_moe_fields(c))
    elif kind == "deepseek_v3":
        from .hf_deepseek import deepseek_config  # it reads this module's shape fields

        cfg = deepseek_config(c)
    else:
        raise ModelConfigError(
            f"model_type {kind!r} not supported; gridtrain imports 'gpt2', {', '.join(map(repr, LLAMA_LIKE))}, "
            f"'deepseek_v3'"
        )
    return cfg.replace(**overrides)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The ``config.json`` of the ``transformers`` model that ``cfg`` is (inverse of :func:`config_from_hf`)."""
    if cfg.arch == "gpt":
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": cfg.n_layers,
            "n_embd": cfg.d_model,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": cfg.tie_embeddings,
        }
    if cfg.mla:
        from .hf_deepseek import deepseek_config_dict

        return deepseek_config_dict(cfg)
    if cfg.moe_experts and cfg.qk_norm:  # Qwen3-MoE
        if cfg.moe_shared_experts:
            raise ModelConfigError("Qwen3-MoE has no shared experts; moe_shared_experts does not export")
        moe = {
            "num_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.moe_d_ff or cfg.d_ff,
            "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": list(range(cfg.moe_first_dense)),
            "norm_topk_prob": cfg.moe_normalize_top_k,
            "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        }
        return _llama_config(cfg) | {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]} | moe
    if cfg.moe_experts:
        if cfg.moe_every != 1 or cfg.moe_shared_experts or cfg.moe_d_ff not in (None, cfg.d_ff) or cfg.moe_first_dense:
            raise ModelConfigError("only Mixtral-shaped MoE (every layer, no shared experts, d_ff) exports to HF")
        moe = {
            "num_local_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.moe_aux_loss_weight,
            "sliding_window": None,
        }
        return _llama_config(cfg) | {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]} | moe
    return _llama_config(cfg)


def _llama_config(cfg: ModelConfig) -> dict:
    kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.bias("qkv") and not cfg.bias("o") else "llama"
    extra: dict = {"head_dim": cfg.head_dim}
    if kind == "llama":
        extra.update(attention_bias=cfg.bias("qkv"), mlp_bias=cfg.bias("mlp"))
        if cfg.bias("qkv") != cfg.bias("o"):
            raise ModelConfigError(
                "Llama's attention_bias covers q, k, v and o alike; qkv_bias ≠ o_bias does not export"
            )
    elif kind == "qwen3":
        extra.update(attention_bias=cfg.bias("qkv"), use_sliding_window=False)
    else:
        extra.update(use_sliding_window=False)
    if kind != "llama" and cfg.bias("mlp"):
        raise ModelConfigError(f"{kind} has no MLP biases; mlp_bias does not export")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    return extra | {
        "rope_parameters": hf_rope_parameters(cfg),
        "model_type": kind,
        "architectures": [arch],
        "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
    }
