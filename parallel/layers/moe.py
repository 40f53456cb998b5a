"""Mixture of experts with expert parallelism (Switch / GShard / Mixtral style).

:class:`MoELayer` replaces a transformer MLP: a router picks ``top_k`` of ``num_experts``
SwiGLU or GELU experts per token (softmax gating, optionally renormalised over the chosen k, as
Mixtral does), optional always-on shared experts are added, and a Switch/GShard load-balancing
loss plus a router z-loss are attached to the output's backward (no extra loss plumbing: a
pipeline stage's backward carries them, as in Megatron-Core's aux-loss scaler).

**Expert parallelism.** The ``ep`` group (``ParallelGroups.ep``) splits the experts: rank ``r``
holds global experts ``[r·L, (r+1)·L)``, ``L = num_experts / ep``. Every rank routes its own
tokens, then per layer call:

1. an all-to-all of the per-expert token counts (``num_experts`` int64 each way);
2. **one host read** of those counts (send and receive sizes of the uneven exchange): inherent
   to dropless all-to-all — NCCL's ``all_to_all_single`` takes its split sizes on the host, and
   the receive buffer's size depends on other ranks' routing. The read waits for this layer's
   router on the device (the only per-call synchronisation; with ``ep == 1`` the same read
   gives the local experts' segment sizes);
3. all-to-all (uneven) of the routed token rows ``[n, d]`` out, experts, all-to-all back; the
   backward does the same two in reverse. Bytes: ``k·T·d`` elements each way per rank when
   nothing is dropped (``T`` local tokens), of which ``(ep-1)/ep`` leave the rank under
   balanced routing — the counter records the payload (``input`` rows) and that fraction.

**Grouped computation.** Tokens are sorted by expert (a stable argsort, so the token order within
an expert is deterministic) and each expert weight is applied to all the ``L`` local experts'
contiguous segments at once (:class:`.experts.GroupedExperts` over :mod:`.grouped_mm`: one
``grouped_mm`` kernel, one padded ``bmm``, or a loop over the ``L`` experts, never over tokens, chosen
once per device type).

**Compilation** (``train.compile``, :func:`parallel.compile.compile_moe`): :meth:`MoELayer.route_tokens`
(everything before the host read) and the experts' grouped computation are regions of their own; steps
1-3 above and the combine stay eager between them, sized by the host ints (docs/compile.md).

**Routing and capacity**: :mod:`.moe_routing` (softmax, or DeepSeek-V3's sigmoid scores with
group-limited choice). With sigmoid scores the layer holds ``e_score_correction_bias`` (fp32 ``[E]``,
all global experts on every rank), which only selection reads; :func:`update_router_bias_` moves it
after each optimizer step from the load the training forwards counted (aux-loss-free balancing).

**Gradients.** Expert parameters (marked :func:`parallel.params.mark_expert`) receive the
gradient of every ep rank's tokens routed to them; dense parameters (router, shared experts) only
of this rank's. Averaging expert grads over ``edp`` and dense ones over ``dp`` then gives both
the mean over the dp ranks provided expert grads are divided by ``dp`` (= ``edp · ep``), not
``edp``.

**Tensor parallelism.** Experts are not split over TP: with tp > 1 and no sequence parallelism
each TP rank computes the same experts on the same (replicated) tokens.

**Sequence parallelism**: each TP rank routes, dispatches and combines only its own ``s/tp`` tokens
of every sequence, so the experts' work is no longer repeated over TP. The router and the experts
are then replicated parameters that saw a slice of the sequence: they are marked
:func:`~parallel.params.mark_sequence_parallel`, and their gradients summed over TP with the norms'
— an all-reduce of the expert gradients over TP once per step, which Megatron-Core avoids by folding
TP into the expert-parallel group (experts sharded over tp × ep); gridtrain does not fold them. The router statistics (balance loss, z-loss, sequence-wise loss) are summed over TP before
the losses are formed (:func:`aux_losses`, one all-reduce of ``2E + 1`` floats per layer call,
backward identity), so every layout computes one process's losses; the aux-loss-free load is summed
over TP too (the engine passes the TP group to :func:`update_router_bias_`). Shared experts are a
:class:`ParallelMLP` with sequence parallelism (all-gather in, reduce-scatter out). Routing is
dropless only (:data:`SEQUENCE_PARALLEL_CAPACITY_REFUSED`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .. import comm
from ..params import mark_sequence_parallel
from .experts import GroupedExperts  # noqa: F401 - re-exported (its home before it had one)
from .mlp import ParallelMLP
from .moe_routing import (  # noqa: F401 - the router's public names, re-exported
    CONTEXT_PARALLEL_CAPACITY_REFUSED,
    CONTEXT_PARALLEL_SEQ_AUX_REFUSED,
    SEQUENCE_PARALLEL_CAPACITY_REFUSED,
    MoEConfig,
    MoEConfigError,
    Routing,
    all_reduce_sum_both_ways,
    aux_losses,
    kept_assignments,
    route,
    router_stats_numel,
    sequence_aux_loss,
    sequence_stats_numel,
)


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=n)`` (int64) that also runs on ``meta``."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(0, index, torch.ones_like(index))


def _read_counts(counts: torch.Tensor, assignments: int, halves: int = 1) -> list[int]:
    """The one host read of a layer call (module docstring). On ``meta`` (the dry run: no values)
    every rank is taken to spread its ``assignments`` evenly over the experts (remainder first);
    ``halves`` = 2 when ``counts`` is the sent counts followed by the received ones."""
    if counts.device.type != "meta":
        return counts.tolist()
    experts = counts.numel() // halves
    per, extra = divmod(assignments, experts)
    return [per + (i < extra) for i in range(experts)] * halves


class RoutedTokens(NamedTuple):
    """:meth:`MoELayer.route_tokens`'s result for ``T`` local tokens, each a device tensor.

    ``order`` ``[T·k]``: the assignments (``t·k + j``) sorted by expert, stably, the dropped ones last;
    ``weights`` ``[T·k]`` fp32: each one's gate weight, in that order; ``counts`` ``[E + 1]`` int64: kept
    assignments per global expert, then the dropped; ``tokens_per_expert`` ``[E]``: assignments before
    dropping; ``aux`` (the weighted router loss), ``balance`` and ``z``: scalars."""

    order: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux: torch.Tensor
    balance: torch.Tensor
    z: torch.Tensor


class _AttachAux(torch.autograd.Function):
    """Identity on ``out``; backward also sends ``scale`` as the gradient of ``aux`` (a scalar loss)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group, output_split_sizes=out_splits, input_split_sizes=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all(gx, grad.contiguous(), ctx.group, output_split_sizes=in_splits, input_split_sizes=out_splits)
        return gx, None, None, None


class MoELayer(nn.Module):
    """Router + experts (+ shared experts), input/output ``[..., d_model]``; see the module docstring.

    After each forward, ``last_stats`` holds device tensors (no host read): ``aux_loss`` (weighted
    total), ``balance_loss``, ``z_loss``, ``tokens_per_expert`` ``[E]`` (this rank's assignments per
    global expert, before dropping) and ``dropped`` (this rank's dropped assignments); training
    forwards also add them up on the device for :func:`moe_metrics` (recomputed forwards of
    activation checkpointing count again).
    ``aux_loss_scale`` multiplies the aux-loss gradient (set it to the main loss's normalisation,
    e.g. 1 / micro-batches).
    """

    def __init__(self, d_model: int, cfg: MoEConfig, *, ep_group=None, tp_group=None,
                 sequence_parallel: bool = False, cp_group=None, device=None, dtype=None):  # fmt: skip
        super().__init__()
        ep = comm.tp_world_size(ep_group)  # None: no expert parallelism (1), not the world
        cfg.check(ep)
        sp_group = tp_group if sequence_parallel and comm.tp_world_size(tp_group) > 1 else None
        if sp_group is not None and cfg.capacity_factor is not None:
            raise MoEConfigError(SEQUENCE_PARALLEL_CAPACITY_REFUSED)
        if comm.tp_world_size(cp_group) > 1 and cfg.capacity_factor is not None:
            raise MoEConfigError(CONTEXT_PARALLEL_CAPACITY_REFUSED)
        if comm.tp_world_size(cp_group) > 1 and cfg.seq_aux_loss_weight:
            raise MoEConfigError(CONTEXT_PARALLEL_SEQ_AUX_REFUSED)
        self.cfg, self.ep_group, self.ep, self.cp_group, self.sp_group = cfg, ep_group, ep, cp_group, sp_group
        self.num_local = cfg.num_experts // ep
        ep_rank = comm.tp_rank(ep_group)
        self.router = nn.Linear(d_model, cfg.num_experts, bias=False, device=device, dtype=dtype)
        self.experts = GroupedExperts(
            self.num_local, d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.bias,
            ep_rank=ep_rank, ep_size=ep, device=device, dtype=dtype,
        )  # fmt: skip
        if sp_group is not None:  # replicated over TP, each rank's gradient from its slice of the sequence
            for p in (self.router.weight, *self.experts.parameters()):
                mark_sequence_parallel(p)
        self.shared = None
        if cfg.num_shared_experts:
            width = cfg.num_shared_experts * (cfg.shared_d_ff or cfg.d_ff)
            self.shared = ParallelMLP(
                d_model, width, activation=cfg.activation, bias=cfg.bias, tp_group=tp_group,
                sequence_parallel=sp_group is not None, device=device, dtype=dtype,
            )  # fmt: skip
        # DeepSeek-V3's selection bias (fp32), every global expert's on every rank; None with softmax scores
        bias = torch.zeros(cfg.num_experts, device=device) if cfg.score_func == "sigmoid" else None
        self.register_buffer("e_score_correction_bias", bias)
        self.load_sum: torch.Tensor | None = None  # assignments per global expert since the last bias update
        self.aux_loss_scale = 1.0
        self.last_stats: dict[str, torch.Tensor] = {}
        self.stats_sum: dict[str, torch.Tensor] = {}
        self.stats_calls = 0

    def route_tokens(self, x: torch.Tensor) -> RoutedTokens:
        """The router's half of a call on ``x`` ``[..., s, d]``: gate, scores, top-k, capacity, the sort by
        expert and the auxiliary losses (their statistics summed over cp / tp under SP through the
        traceable collectives). Device tensors whose shapes follow from ``x``'s alone, no host read: the
        region ``train.compile`` compiles (docs/compile.md)."""
        cfg, E = self.cfg, self.cfg.num_experts
        h = x.reshape(-1, x.shape[-1])
        r = route(self.router(h), cfg, self.e_score_correction_bias)
        balance, z = aux_losses(r, cfg, self.cp_group, self.sp_group)
        aux = cfg.aux_loss_weight * balance + cfg.z_loss_weight * z
        if cfg.seq_aux_loss_weight:
            batch = h.shape[0] // x.shape[-2]
            aux = aux + cfg.seq_aux_loss_weight * sequence_aux_loss(r, cfg, batch, self.sp_group)
        flat_e = r.experts.reshape(-1)  # token-major: assignment a = t·k + j
        keep = kept_assignments(r.experts, cfg)
        if keep is not None:
            flat_e = torch.where(keep.reshape(-1), flat_e, E)  # dropped → sentinel expert E, sorted last
        order = torch.argsort(flat_e, stable=True)
        weights = r.weights.reshape(-1).index_select(0, order)
        return RoutedTokens(order, weights, _count(flat_e, E + 1), _count(r.experts.reshape(-1), E), aux, balance, z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, E, k = self.cfg, self.cfg.num_experts, self.cfg.top_k
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        r = self.route_tokens(x)
        send_counts = r.counts[:E]
        # dispatch and combine: host-driven (the count read sizes the all-to-alls), eager under train.compile
        if self.ep > 1:
            recv_counts = torch.empty_like(send_counts)
            comm.all_to_all(recv_counts, send_counts, self.ep_group)
            host = _read_counts(torch.cat([send_counts, recv_counts]), k * h.shape[0], halves=2)
            send, recv = host[:E], host[E:]
        else:
            send = recv = _read_counts(send_counts, k * h.shape[0])
        P, L = self.ep, self.num_local
        n_send = sum(send)
        order = r.order[:n_send]
        tokens = order // k
        rows = h.index_select(0, tokens)

        if P > 1:
            in_splits = [sum(send[p * L : (p + 1) * L]) for p in range(P)]
            out_splits = [sum(recv[p * L : (p + 1) * L]) for p in range(P)]
            got = _AllToAll.apply(rows, out_splits, in_splits, self.ep_group)
            # received blocks are [source rank][local expert]; regroup to [local expert][source rank]
            block = torch.arange(P * L, device=h.device).view(P, L).t().reshape(-1).argsort()
            key = torch.repeat_interleave(block, recv_counts, output_size=sum(out_splits))
            regroup = torch.argsort(key, stable=True)
            segments = [sum(recv[p * L + i] for p in range(P)) for i in range(L)]
            y = self.experts(got.index_select(0, regroup), segments, counts=recv_counts.view(P, L).sum(0))
            y = y.index_select(0, torch.argsort(regroup))
            y = _AllToAll.apply(y, in_splits, out_splits, self.ep_group)
        else:
            y = self.experts(rows, send, counts=send_counts)

        w = r.weights[:n_send].to(y.dtype)
        out = torch.zeros_like(h).index_add_(0, tokens, y * w.unsqueeze(-1))
        if self.shared is not None:
            out = out + self.shared(x).reshape(h.shape)  # [b, s/tp, d] under SP: gathers the sequence itself
        self.last_stats = {
            "aux_loss": r.aux.detach(),
            "balance_loss": r.balance.detach(),
            "z_loss": r.z.detach(),
            "tokens_per_expert": r.tokens_per_expert,
            "dropped": r.counts[E],
        }
        if torch.is_grad_enabled() and cfg.bias_update_rate:  # the load the next bias update balances
            load = self.last_stats["tokens_per_expert"]
            self.load_sum = load.clone() if self.load_sum is None else self.load_sum + load
        if torch.is_grad_enabled():  # training: add up over the micro-batches until moe_metrics() reads them
            for key, v in self.last_stats.items():
                self.stats_sum[key] = self.stats_sum[key] + v if key in self.stats_sum else v.clone()
            self.stats_calls += 1
        out = _AttachAux.apply(out, r.aux, self.aux_loss_scale) if torch.is_grad_enabled() else out
        return out.view(shape)


def router_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """The MoE layers' selection biases (DeepSeek-V3) by buffer name: ``{"<layer>.e_score_correction_bias": [E]}``."""
    return {
        f"{name}.e_score_correction_bias": m.e_score_correction_bias
        for name, m in model.named_modules()
        if isinstance(m, MoELayer) and m.e_score_correction_bias is not None
    }


def update_router_bias_(model: nn.Module, groups=()) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: every MoE layer with a
    ``bias_update_rate`` γ moves its selection bias by ``γ·sign(mean load − load_e)`` (up for
    under-loaded experts), the load being its assignments per global expert since the last update
    summed over ``groups`` — every group whose ranks route different tokens (the data-parallel
    group, which spans ep, and cp; tp only under sequence parallelism, else its ranks route the same
    tokens). One all-reduce of
    ``[layers, E]`` int64 per group; integer sums, so every rank computes the same bias bit for bit.
    Recomputed forwards (full checkpointing) count every token twice: the sign is unchanged."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.cfg.bias_update_rate]
    if not layers:
        return
    E = layers[0].cfg.num_experts
    dev = layers[0].e_score_correction_bias.device
    zero = torch.zeros(E, dtype=torch.int64, device=dev)
    load = torch.stack([zero if m.load_sum is None else m.load_sum for m in layers])
    for g in groups:
        if comm.tp_world_size(g) > 1:
            load = comm.all_reduce_sum(load, g)
    load = load.double()
    with torch.no_grad():
        for m, row in zip(layers, load):
            step = torch.sign(row.mean() - row).float() * m.cfg.bias_update_rate
            m.e_score_correction_bias.add_(step)
            m.load_sum = None


def moe_metrics(model: nn.Module) -> dict[str, float | list[int]]:
    """This rank's MoE figures since the last call, over all its MoE layers and micro-batches (one
    host read; call it on logged steps only): ``moe_aux_loss`` (mean weighted router loss per layer
    call), ``moe_tokens_per_expert`` (assignments per global expert, summed over layers),
    ``moe_dropped`` (dropped assignments). Resets the sums. Empty without MoE layers or calls."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.stats_calls]
    if not layers:
        return {}
    aux = torch.stack([m.stats_sum["aux_loss"] for m in layers]).sum()
    calls = sum(m.stats_calls for m in layers)
    per_expert = torch.stack([m.stats_sum["tokens_per_expert"] for m in layers]).sum(0)
    dropped = torch.stack([m.stats_sum["dropped"] for m in layers]).sum()
    host = torch.cat([aux.reshape(1).double(), dropped.reshape(1).double(), per_expert.double()]).tolist()
    for m in layers:
        m.stats_sum, m.stats_calls = {}, 0
    return {
        "moe_aux_loss": host[0] / calls,
        "moe_dropped": int(host[1]),
        "moe_tokens_per_expert": [int(v) for v in host[2:]],
    }
