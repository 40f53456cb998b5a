"""Hugging Face ``transformers`` weights for GPT-2, Llama (3.1+), Qwen2, Qwen3, Mixtral and DeepSeek-V3, into and out of any tp / pp layout.

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
``[E, f, d]``, each ep rank loading its slice of the experts; export gathers them over the ep group.
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
from parallel.layers.moe import router_biases
from parallel.params import expert_shard, tp_shard_dim, vocab_rows

from .config import ModelConfig, ModelConfigError
from .hf_config import LLAMA_LIKE, config_from_hf, hf_config_dict  # noqa: F401 (the public names of models.hf)
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
        if cfg.mla:
            rules += _mla_rules(cfg, b, h)
        else:
            rules += [Rule((f"{b}attn.{x}_proj.weight",), f"{h}self_attn.{x}_proj.weight") for x in "qkvo"]
            biased = [x for x in "qkvo" if cfg.bias("o" if x == "o" else "qkv")]
            rules += [Rule((f"{b}attn.{x}_proj.bias",), f"{h}self_attn.{x}_proj.bias") for x in biased]
        if cfg.qk_norm:
            rules += [Rule((f"{b}attn.{x}_norm.weight",), f"{h}self_attn.{x}_norm.weight") for x in "qk"]
        if cfg.is_moe_layer(i):
            rules += _mixtral_expert_rules(cfg.moe_config().d_ff, b, h)
            if cfg.moe_score == "sigmoid":  # DeepSeek-V3's selection bias and shared experts
                rules += [Rule((f"{b}mlp.e_score_correction_bias",), f"{h}mlp.gate.e_score_correction_bias")]
            if cfg.moe_shared_experts:
                rules += [
                    Rule((f"{b}mlp.shared.{x}_proj.weight",), f"{h}mlp.shared_experts.{x}_proj.weight")
                    for x in ("gate", "up", "down")
                ]
        else:
            rules += [Rule((f"{b}mlp.{x}_proj.weight",), f"{h}mlp.{x}_proj.weight") for x in ("gate", "up", "down")]
            if cfg.bias("mlp"):
                rules += [Rule((f"{b}mlp.{x}_proj.bias",), f"{h}mlp.{x}_proj.bias") for x in ("gate", "up", "down")]
    return rules


def _mla_rules(cfg: ModelConfig, b: str, h: str) -> list[Rule]:
    """DeepSeek's multi-head latent attention (``parallel.layers.mla``): the same layouts, other names."""
    names = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj"}
    names |= {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj"} if cfg.q_lora_rank else {}
    names |= {"q_proj": "q_proj"} if not cfg.q_lora_rank else {}
    rules = [
        Rule((f"{b}attn.{o}.weight",), f"{h}self_attn.{t}.weight") for o, t in (names | {"o_proj": "o_proj"}).items()
    ]
    if cfg.bias("qkv"):
        biased = [o for o in ("q_a_proj", "kv_a_proj") if o in names] + ["o_proj"]
        rules += [Rule((f"{b}attn.{o}.bias",), f"{h}self_attn.{names.get(o, o)}.bias") for o in biased]
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


# the Hub's per-expert names on disk: Mixtral's (w1 gate, w3 up, w2 down; the router block_sparse_moe.gate)
# and Qwen3-MoE's (gate_proj, up_proj, down_proj under mlp.experts.<e>; the router is mlp.gate already)
_PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))|mlp\.experts\.(\d+)\.(gate|up|down)_proj)\.weight$"
)
_AS_W = {"gate": "w1", "down": "w2", "up": "w3"}


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
                layer, e, w, gate, e2, proj = m.groups()
                if proj:
                    e, w = e2, _AS_W[proj]
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
    params = dict(stage.named_parameters()) | router_biases(stage)  # DeepSeek's selection biases: buffers HF holds
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


def export_hf_state_dict(stage: nn.Module, tp_group=None, ep_group=None) -> dict[str, torch.Tensor]:
    """This stage's weights under ``transformers`` names and layouts, gathered on every rank: one
    all-gather per TP-sharded parameter on ``tp_group``, and per expert tensor split over ep one on
    ``ep_group`` (every global expert, as at ep = 1). A tied head is omitted, as HF does."""
    ours = gather_full_state_dict(stage, tp_group, ep_group=ep_group)
    ours |= router_biases(stage)  # DeepSeek's selection biases: buffers HF holds
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
