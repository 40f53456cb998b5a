"""Hugging Face ``transformers`` weights for GPT-2, Llama (3.1+), Qwen2, Qwen3 and Mixtral, into and out of any tp / pp layout.

``load_hf_weights(stage, source, tp_group)`` fills a stage from a ``transformers``
state dict or a folder of ``*.safetensors`` as ``save_pretrained`` writes it: each
rank reads, one tensor at a time, the full tensors its parameters need and keeps its
shard (no communication; peak scratch one full tensor, never the whole model).
``export_hf_state_dict(stage, tp_group)`` gathers a stage back into ``transformers``
names and layout; ``save_hf_safetensors`` writes it. ``config_from_hf`` reads the
model shape from a ``transformers`` config (or its ``config.json`` dict).

``transformers`` itself is never imported here: only its tensor names and layouts.
GPT-2's ``Conv1D`` stores ``[in, out]`` and fuses q, k, v in ``c_attn``; Llama's
weights are already ``nn.Linear``-shaped and use the rotate-half rotary layout. Mixtral's
experts are ``transformers`` ≥ 5's stacked tensors (``experts.gate_up_proj`` ``[E, 2f, d]``,
``experts.down_proj`` ``[E, d, f]``, router ``mlp.gate.weight``); ours are ``[E, d, f]`` /
``[E, f, d]``, each ep rank loading its slice of the experts (export needs ep = 1).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from parallel import comm
from parallel.params import expert_shard, tp_shard_dim, vocab_rows

from .config import ModelConfig, ModelConfigError
from .transformer import gather_full_state_dict


@dataclass(frozen=True)
class Rule:
    """Our parameter names ↔ one HF tensor: ``to_ours(hf) -> tuple``, ``to_hf(*ours) -> hf``."""

    ours: tuple[str, ...]
    hf: str
    to_ours: Callable[[torch.Tensor], tuple] = lambda t: (t,)
    to_hf: Callable[..., torch.Tensor] = lambda t: t


def _t(t: torch.Tensor) -> tuple:
    return (t.t().contiguous(),)


def _gpt2_rules(cfg: ModelConfig, prefix: str) -> list[Rule]:
    rules = [
        Rule(("tok_embed.weight",), f"{prefix}wte.weight"),
        Rule(("pos_embed.weight",), f"{prefix}wpe.weight"),
        Rule(("norm_f.weight",), f"{prefix}ln_f.weight"),
        Rule(("norm_f.bias",), f"{prefix}ln_f.bias"),
    ]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"{prefix}h.{i}."
        qkv = tuple(f"{b}attn.{x}_proj" for x in "qkv")
        rules += [
            Rule((f"{b}attn_norm.weight",), f"{h}ln_1.weight"),
            Rule((f"{b}attn_norm.bias",), f"{h}ln_1.bias"),
            Rule(
                tuple(n + ".weight" for n in qkv),
                f"{h}attn.c_attn.weight",
                lambda t: tuple(t.t().chunk(3, 0)),
                lambda *ws: torch.cat(ws, 0).t(),
            ),
            Rule(
                tuple(n + ".bias" for n in qkv),
                f"{h}attn.c_attn.bias",
                lambda t: tuple(t.chunk(3, 0)),
                lambda *bs: torch.cat(bs, 0),
            ),
            Rule((f"{b}attn.o_proj.weight",), f"{h}attn.c_proj.weight", _t, torch.t),
            Rule((f"{b}attn.o_proj.bias",), f"{h}attn.c_proj.bias"),
            Rule((f"{b}mlp_norm.weight",), f"{h}ln_2.weight"),
            Rule((f"{b}mlp_norm.bias",), f"{h}ln_2.bias"),
            Rule((f"{b}mlp.fc_in.weight",), f"{h}mlp.c_fc.weight", _t, torch.t),
            Rule((f"{b}mlp.fc_in.bias",), f"{h}mlp.c_fc.bias"),
            Rule((f"{b}mlp.fc_out.weight",), f"{h}mlp.c_proj.weight", _t, torch.t),
            Rule((f"{b}mlp.fc_out.bias",), f"{h}mlp.c_proj.bias"),
        ]
    return rules


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [Rule(("tok_embed.weight",), "model.embed_tokens.weight"), Rule(("norm_f.weight",), "model.norm.weight")]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        rules += [
            Rule((f"{b}attn_norm.weight",), f"{h}input_layernorm.weight"),
            Rule((f"{b}mlp_norm.weight",), f"{h}post_attention_layernorm.weight"),
        ]
        rules += [Rule((f"{b}attn.{x}_proj.weight",), f"{h}self_attn.{x}_proj.weight") for x in "qkvo"]
        biased = [x for x in "qkvo" if cfg.bias("o" if x == "o" else "qkv")]
        rules += [Rule((f"{b}attn.{x}_proj.bias",), f"{h}self_attn.{x}_proj.bias") for x in biased]
        if cfg.qk_norm:
            rules += [Rule((f"{b}attn.{x}_norm.weight",), f"{h}self_attn.{x}_norm.weight") for x in "qk"]
        if cfg.is_moe_layer(i):
            rules += _mixtral_expert_rules(cfg.moe_config().d_ff, b, h)
        else:
            rules += [Rule((f"{b}mlp.{x}_proj.weight",), f"{h}mlp.{x}_proj.weight") for x in ("gate", "up", "down")]
            if cfg.bias("mlp"):
                rules += [Rule((f"{b}mlp.{x}_proj.bias",), f"{h}mlp.{x}_proj.bias") for x in ("gate", "up", "down")]
    return rules


def _mixtral_expert_rules(f: int, b: str, h: str) -> list[Rule]:
    swap = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    return [
        Rule((f"{b}mlp.router.weight",), f"{h}mlp.gate.weight"),
        Rule(
            (f"{b}mlp.experts.gate_proj", f"{b}mlp.experts.up_proj"),
            f"{h}mlp.experts.gate_up_proj",
            to_ours=lambda t: (swap(t[:, :f]), swap(t[:, f:])),
            to_hf=lambda gate, up: torch.cat([swap(gate), swap(up)], dim=1),
        ),
        Rule((f"{b}mlp.experts.down_proj",), f"{h}mlp.experts.down_proj", to_ours=lambda t: (swap(t),), to_hf=swap),
    ]


def hf_rules(cfg: ModelConfig, hf_keys=()) -> list[Rule]:
    """The name/layout correspondence for ``cfg``; the head reads the embedding when tied."""
    if cfg.arch == "gpt":
        prefix = "" if any(k.startswith("h.") for k in hf_keys) else "transformer."
        rules, embed = _gpt2_rules(cfg, prefix), f"{prefix}wte.weight"
    else:
        rules, embed = _llama_rules(cfg), "model.embed_tokens.weight"
    tied = cfg.tie_embeddings or (bool(hf_keys) and "lm_head.weight" not in hf_keys)
    return rules + [Rule(("lm_head.weight",), embed if tied else "lm_head.weight")]


LLAMA_LIKE = ("llama", "mixtral", "qwen2", "qwen3")


def _rope_fields(c: Mapping) -> dict:
    """Our rotary fields from a ``transformers`` config's ``rope_parameters`` (≥ 5) or ``rope_scaling``."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)), "rope_type": kind}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise ModelConfigError(f"rope_type {kind!r} is not supported (default, linear, llama3)")
    out["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return out


def _llama_like_config(c: Mapping, kind: str) -> ModelConfig:
    """Llama (3.1+ rope scaling, biases, head_dim), Mixtral, Qwen2 (q/k/v biases), Qwen3 (QK-norm)."""
    if c.get("use_sliding_window"):
        raise ModelConfigError(f"{kind} sliding-window attention is not supported (set use_sliding_window=false)")
    attention_bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        arch="llama",
        n_layers=c["num_hidden_layers"],
        d_model=c["hidden_size"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        attn_head_dim=c["head_dim"]
        if c.get("head_dim") not in (None, c["hidden_size"] // c["num_attention_heads"])
        else None,
        d_ff=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_len=c["max_position_embeddings"],
        norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=c.get("tie_word_embeddings", False),
        qkv_bias=True if kind == "qwen2" else attention_bias,
        o_bias=attention_bias and kind != "qwen2",
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=kind == "qwen3",
        **_rope_fields(c),
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
    else:
        raise ModelConfigError(
            f"model_type {kind!r} not supported; gridtrain imports 'gpt2', {', '.join(map(repr, LLAMA_LIKE))}"
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
    if cfg.moe_experts:
        if cfg.moe_every != 1 or cfg.moe_shared_experts or cfg.moe_d_ff not in (None, cfg.d_ff):
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
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    return extra | {
        "rope_parameters": rope,
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


_PER_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))\.weight$")


class _Source:
    """Read HF tensors by name from a state dict or a folder of safetensors files, lazily.

    A Mixtral folder that ``save_pretrained`` wrote holds the Hub's per-expert tensors
    (``block_sparse_moe.experts.<e>.w1|w2|w3``, ``block_sparse_moe.gate``); they are read here under
    the in-memory names of ``transformers`` ≥ 5 (``mlp.experts.gate_up_proj`` ``[E, 2f, d]``: w1 then w3
    stacked; ``mlp.experts.down_proj`` ``[E, d, f]``: w2; ``mlp.gate.weight``), one layer's at a time."""

    def __init__(self, source):
        if isinstance(source, (str, os.PathLike)):
            from safetensors import safe_open

            files = sorted(glob.glob(os.path.join(source, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {source}")
            where = {}
            self._handles = [safe_open(f, framework="pt") for f in files]
            for h in self._handles:
                where.update({k: h for k in h.keys()})
            read = lambda k: where[k].get_tensor(k)  # noqa: E731
        else:
            where, read = source, source.__getitem__
        self._read, self._where = read, dict.fromkeys(where)
        self._virtual: dict[str, Callable[[], torch.Tensor]] = {}
        experts: dict[str, dict[str, dict[int, str]]] = {}
        for key in where:
            if m := _PER_EXPERT.match(key):
                layer, e, w, gate = m.groups()
                if gate:
                    self._virtual[f"{layer}.mlp.gate.weight"] = lambda k=key: read(k)
                else:
                    experts.setdefault(layer, {}).setdefault(w, {})[int(e)] = key
        for layer, ws in experts.items():
            keys = {w: [ws[w][e] for e in sorted(ws[w])] for w in ("w1", "w2", "w3")}
            self._virtual[f"{layer}.mlp.experts.gate_up_proj"] = lambda k=keys: torch.stack(
                [torch.cat([read(a), read(b)], 0) for a, b in zip(k["w1"], k["w3"])]
            )
            self._virtual[f"{layer}.mlp.experts.down_proj"] = lambda k=keys: torch.stack([read(a) for a in k["w2"]])

    def get(self, key: str) -> torch.Tensor:
        return self._virtual[key]() if key in self._virtual else self._read(key)

    def keys(self):
        return [*self._where, *self._virtual]

    def __contains__(self, key: str) -> bool:
        return key in self._where or key in self._virtual


def load_hf_weights(stage: nn.Module, source, tp_group=None) -> nn.Module:
    """Copy HF weights (state dict or safetensors folder) into ``stage``'s shards; returns ``stage``.

    Every parameter of the stage must be found; shapes are checked against the
    stage's full (gathered) shapes. No communication.
    """
    src = _Source(source)
    keys = src.keys()
    params = dict(stage.named_parameters())
    tp, filled = comm.tp_world_size(tp_group), set()
    for rule in hf_rules(stage.cfg, keys):
        if not all(n in params for n in rule.ours):
            continue
        if rule.hf not in src:
            raise KeyError(f"{rule.hf!r} (for {rule.ours[0]}) missing from the Hugging Face weights")
        for name, full in zip(rule.ours, rule.to_ours(src.get(rule.hf))):
            p = params[name]
            dim = tp_shard_dim(p)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            if expert_shard(p) is not None:  # this ep rank's experts: rows [r·L, (r+1)·L) of the global [E, ...]
                ep_rank, ep = expert_shard(p)
                shape[0] *= ep
                if list(full.shape) == shape:
                    full = full[ep_rank * p.shape[0] : (ep_rank + 1) * p.shape[0]]
                shape[0] = p.shape[0]
            if vocab_rows(p) is not None and full.shape[0] == p.vocab_size:
                full = torch.cat([full, full.new_zeros(shape[0] - full.shape[0], *full.shape[1:])])
            if list(full.shape) != shape:
                raise ModelConfigError(
                    f"{rule.hf} has shape {tuple(full.shape)}, but {name} needs {tuple(shape)} "
                    f"(check vocab_size / d_model / heads of the config)"
                )
            with torch.no_grad():
                p.copy_(full if dim is None else comm.split_along(full, dim, tp_group))
            filled.add(name)
    missing = set(params) - filled
    if missing:
        raise KeyError(f"parameters not found in the Hugging Face weights: {sorted(missing)}")
    return stage


def export_hf_state_dict(stage: nn.Module, tp_group=None) -> dict[str, torch.Tensor]:
    """This stage's weights under ``transformers`` names and layouts (gathered over TP on
    every rank: one all-gather per sharded parameter). A tied head is omitted, as HF does."""
    if any((expert_shard(p) or (0, 1))[1] > 1 for p in stage.parameters()):
        raise ModelConfigError("HF export of MoE experts split over ep > 1 is not supported; export at ep = 1")
    ours = gather_full_state_dict(stage, tp_group)
    out = {}
    for rule in hf_rules(stage.cfg):
        if all(n in ours for n in rule.ours) and not (rule.ours == ("lm_head.weight",) and stage.cfg.tie_embeddings):
            out[rule.hf] = rule.to_hf(*(ours[n] for n in rule.ours)).contiguous()
    return out


def save_hf_safetensors(state_dict: Mapping[str, torch.Tensor], folder: str, hf_config: dict | None = None) -> str:
    """Write ``state_dict`` as ``folder/model.safetensors`` (and ``config.json`` if given); returns the file."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, path, metadata={"format": "pt"})
    if hf_config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
    return path
