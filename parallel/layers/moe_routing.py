"""The MoE router: a layer's configuration, top-k gating, capacity and the auxiliary losses.

Pure functions of the router logits and :class:`MoEConfig` (plus one all-reduce over the
context-parallel group in :func:`aux_losses`), used by :class:`~parallel.layers.moe.MoELayer` and
by tests that check routing without building a layer.

**Capacity.** ``capacity_factor=None`` (default) is dropless. Otherwise each expert accepts at
most ``ceil(capacity_factor · T · k / num_experts)`` of *this rank's* assignments (``T`` local
tokens), in priority order: all first choices (token order) before all second choices (GShard);
dropped assignments contribute nothing (weights are not renormalised).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import comm
from ..comm.autograd import autograd_pair
from .linear import LayerConfigError
from .mlp import ACTIVATIONS


class MoEConfigError(LayerConfigError):
    """An MoE configuration that cannot run (sizes, top-k, expert split)."""


#: the refusal of capacity-limited routing under sequence parallelism (the layer's, the planner's and the
#: recipe's): a tp rank routes a slice of each sequence, so its drops would differ from the whole micro-batch's
SEQUENCE_PARALLEL_CAPACITY_REFUSED = (
    "MoE with sequence parallelism routes dropless only: with a capacity factor an expert's drops depend on "
    "every token of the micro-batch, and a tp rank routes a slice of each sequence; set "
    "model.moe_capacity_factor=null (dropless) or parallel.sequence_parallel=false"
)
#: the refusal of capacity-limited routing under context parallelism (the layer's and the recipe's): which
#: assignments an expert drops depends on the arrival order of every token of the micro-batch, and a cp rank
#: holds a slice of each sequence
CONTEXT_PARALLEL_CAPACITY_REFUSED = (
    "MoE with context parallelism (cp > 1) routes dropless only: with a capacity factor an expert's drops "
    "depend on every token of the micro-batch, and a cp rank routes a slice of each sequence; set "
    "model.moe_capacity_factor=null (dropless) or cp=1"
)

#: the refusal of DeepSeek-V3's sequence-wise balance loss under context parallelism (the layer's and the
#: recipe's): it is a function of each whole sequence's routing, and a cp rank holds a slice of each
CONTEXT_PARALLEL_SEQ_AUX_REFUSED = (
    "MoE with context parallelism (cp > 1): the sequence-wise aux loss needs whole sequences, and a cp rank "
    "routes a slice of each; set model.moe_seq_aux_loss_weight=0 or cp=1"
)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape and routing.

    ``num_shared_experts`` always-on experts of width ``shared_d_ff`` each (default ``d_ff``) are
    fused into one MLP of width ``num_shared_experts · shared_d_ff``. ``aux_loss_weight`` scales
    the Switch load-balancing loss ``E · Σ_e f_e · P_e`` (``f_e``: fraction of the ``T·k``
    assignments to expert ``e`` before dropping, ``P_e``: mean router probability);
    ``z_loss_weight`` the router z-loss ``mean(logsumexp(logits)²)``.
    """

    num_experts: int
    d_ff: int
    top_k: int = 2
    activation: str = "swiglu"
    bias: bool = False
    num_shared_experts: int = 0
    shared_d_ff: int | None = None
    capacity_factor: float | None = None
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    normalize_top_k: bool = True
    # DeepSeek-V3: sigmoid scores, group-limited selection, a selection-only bias (aux-loss-free balancing)
    score_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1  # experts in n_group equal groups; a token picks from its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    bias_update_rate: float = 0.0  # the selection bias moves by this × sign(mean load − load) per step
    seq_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss

    def check(self, ep_size: int = 1) -> None:
        """Raise :class:`MoEConfigError` naming the numbers and the fix when this cannot run."""
        E, k = self.num_experts, self.top_k
        if E < 1 or self.d_ff < 1:
            raise MoEConfigError(f"MoE: num_experts={E} and d_ff={self.d_ff} must be ≥ 1")
        if not 1 <= k <= E:
            raise MoEConfigError(f"MoE: top_k={k} must be between 1 and num_experts={E}; lower top_k")
        if E % ep_size:
            raise MoEConfigError(
                f"MoE: num_experts={E} is not divisible by ep={ep_size}; choose ep among "
                f"{[d for d in range(1, E + 1) if E % d == 0]}"
            )
        if self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"MoE: activation {self.activation!r} not in {ACTIVATIONS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise MoEConfigError(f"MoE: capacity_factor={self.capacity_factor} must be > 0 (or None: dropless)")
        if self.num_shared_experts < 0:
            raise MoEConfigError(f"MoE: num_shared_experts={self.num_shared_experts} must be ≥ 0")
        if self.score_func not in SCORE_FUNCS:
            raise MoEConfigError(f"MoE: score_func {self.score_func!r} not in {SCORE_FUNCS}")
        G, g = self.n_group, self.topk_group
        if G < 1 or E % G or not 1 <= g <= G or (G > 1 and E // G < 2) or g * (E // G) < k:
            raise MoEConfigError(
                f"MoE: n_group={G}, topk_group={g} do not fit num_experts={E}, top_k={k}: n_group must divide "
                f"the experts into groups of ≥ 2, and topk_group groups must hold ≥ top_k experts"
            )
        if self.bias_update_rate and self.score_func != "sigmoid":
            raise MoEConfigError("MoE: bias_update_rate (aux-loss-free balancing) needs score_func='sigmoid'")

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert accepts from ``tokens`` local tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


#: the router's score functions: Mixtral/Qwen's softmax, DeepSeek-V3's sigmoid
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """The router's decision for ``T`` tokens: ``experts``/``weights`` ``[T, k]``, ``probs`` ``[T, E]``."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


def route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None) -> Routing:
    """Top-k gating in fp32 (ties broken by ``torch.topk``).

    ``softmax``: the k largest probabilities. ``sigmoid`` (DeepSeek-V3): scores ``σ(logits)``; the
    choice ranks ``score + bias`` (``bias`` ``[E]``: selection only, no gradient), first keeping the
    ``topk_group`` of ``n_group`` groups whose two best choice values sum highest; the weights are
    the chosen *scores* (renormalised if ``normalize_top_k``). Either way the weights are then
    multiplied by ``routed_scaling_factor``. ``probs``: the softmax, or the scores normalised per
    token (what the sequence-wise loss averages)."""
    logits = logits.float()
    if cfg.score_func == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, experts = probs.topk(cfg.top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores.detach() if bias is None else scores.detach() + bias
        if cfg.n_group > 1:
            T, G = choice.shape[0], cfg.n_group
            grouped = choice.view(T, G, -1)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros(T, G, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
        experts = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    if cfg.normalize_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.score_func == "sigmoid" else 0.0))
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return Routing(experts, weights, probs, logits)


def sequence_aux_loss(r: Routing, cfg: MoEConfig, batch: int, sp_group=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, unweighted: per sequence ``Σ_e f_e·P_e`` with
    ``f_e = E/(k·S)·(assignments to e)`` and ``P_e`` the mean normalised score over its ``S`` tokens,
    averaged over the ``batch`` sequences (rows of ``r`` are ``batch × S`` tokens, sequence-major).

    ``sp_group``: the sequence-parallel ranks holding the other slices of these sequences; the
    per-sequence counts and score sums (``[batch, 2E]`` fp32) are summed over it first, backward
    identity (:func:`parallel.comm.reduce_from_tp_region`)."""
    E, k = cfg.num_experts, cfg.top_k
    probs = r.probs.view(batch, -1, E)
    S = probs.shape[1]
    onehot = torch.zeros(batch, S * k, E, device=probs.device).scatter_(2, r.experts.view(batch, S * k, 1), 1.0)
    sums = torch.cat([onehot.sum(dim=1), probs.sum(dim=1)], dim=-1)  # sequence_stats_numel(E, batch)
    sums = comm.reduce_from_tp_region(sums, sp_group)
    S *= comm.tp_world_size(sp_group)
    return (sums[:, :E] * (E / (k * S)) * (sums[:, E:] / S)).sum(dim=-1).mean()


def sequence_stats_numel(num_experts: int, batch: int) -> int:
    """Elements of the per-sequence statistics :func:`sequence_aux_loss` sums over tp under sequence
    parallelism: each of the ``batch`` sequences' assignment counts and score sums per expert (fp32)."""
    return batch * 2 * num_experts


def router_stats_numel(num_experts: int) -> int:
    """Elements of the router statistics :func:`aux_losses` sums over cp (and tp under sequence
    parallelism): the probability sums and assignment counts per expert, and the z-loss sum (fp32)."""
    return 2 * num_experts + 1


def aux_losses(r: Routing, cfg: MoEConfig, cp_group=None, sp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of one routing, unweighted.

    The balance loss ``E·Σ_e f_e·P_e`` is a product of two means over *all* of a micro-batch's
    tokens (``f``: the fraction of assignments to expert e, ``P``: its mean router probability),
    the z-loss ``mean(logsumexp(logits)²)`` a mean over them: so the probability sums, assignment
    counts and the z-loss sum (:func:`router_stats_numel` fp32) are summed over the ranks holding
    the other slices of these sequences first, and every one of them computes the same two losses.

    ``cp_group`` (context parallelism): one all-reduce whose backward all-reduces the gradient
    (every cp rank adds the same loss, and the gradient average over dp·cp gives one process's).
    ``sp_group`` (the tp group under sequence parallelism): one all-reduce, backward identity
    (every tp rank adds the same loss and its tokens' share of the gradient; the router's and the
    experts' gradients are then *summed* over tp, as a sequence-parallel parameter's are)."""
    E = cfg.num_experts
    counts = torch.zeros(E, device=r.probs.device).index_add_(
        0, r.experts.reshape(-1), torch.ones(r.experts.numel(), device=r.probs.device)
    )
    z_sum = torch.logsumexp(r.logits, dim=-1).square().sum()
    sums = torch.cat([r.probs.sum(dim=0), counts, z_sum.reshape(1)])
    cp = comm.tp_world_size(cp_group)
    if cp > 1:
        sums = all_reduce_sum_both_ways(sums, cp_group)
    sums = comm.reduce_from_tp_region(sums, sp_group)  # Megatron's "g"
    tokens = max(r.probs.shape[0] * cp * comm.tp_world_size(sp_group), 1)
    frac = sums[E : 2 * E] / (tokens * r.experts.shape[-1])
    balance = E * (frac * sums[:E] / tokens).sum()
    return balance, sums[2 * E] / tokens


# sum over the group; backward sums the gradient over the group too (each rank's loss uses the sum)
_AllReduceBothWays = autograd_pair(
    "_AllReduceBothWays", comm.all_reduce_sum, lambda grad, group: comm.all_reduce_sum(grad.contiguous(), group)
)


def all_reduce_sum_both_ways(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group``, differentiably: the gradient is summed over the group as well."""
    return _AllReduceBothWays.apply(x, group)


def kept_assignments(experts: torch.Tensor, cfg: MoEConfig) -> torch.Tensor | None:
    """Bool ``[T, k]``: which assignments fit their expert's capacity (None: dropless, all)."""
    cap = cfg.capacity(experts.shape[0])
    if cap is None:
        return None
    slot_major = experts.t().reshape(-1)  # first choices of every token, then second choices …
    onehot = F.one_hot(slot_major, cfg.num_experts)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # arrival order within its expert
    return (position < cap).view(cfg.top_k, -1).t()
