"""The planner's view of a mixture-of-experts model (:mod:`parallel.layers.moe`): parameters (``E``
experts and a router per MoE block, ``k`` used per token), memory (experts over ``ep``, their ZeRO states
over ``edp``), the dropless all-to-alls (counts, then the routed rows out and back), active FLOPs. docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import PlanError
from .shape import ModelShape

#: the count exchange's element: int64 (parallel.layers.moe exchanges int64 counts)
COUNT_BYTES = 8


@dataclass(frozen=True)
class MoEShape(ModelShape):
    """What the planner needs of an MoE decoder (a ``ModelConfig`` with ``moe_experts > 0``)."""

    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_d_ff: int | None = None
    moe_shared_experts: int = 0
    moe_capacity_factor: float | None = None  # None: dropless (the only routing cp can take)
    moe_first_dense: int = 0  # the first blocks keep their MLP (DeepSeek's first_k_dense_replace)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing: the load all-reduce after each step
    moe_seq_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise loss: per-sequence sums over SP's tp
    moe_score: str = "softmax"  # the router's scores: softmax, or DeepSeek-V3's sigmoid
    moe_normalize_top_k: bool = True  # top-k weights renormalised to sum 1 (eager keeps the sum and the weights)

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` has experts (``models.config.ModelConfig.is_moe_layer``)."""
        return bool(self.moe_experts) and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    def mlp_params(self, width: int) -> int:
        """One MLP / expert of hidden ``width`` (SwiGLU without biases for llama, GELU with)."""
        if self.arch == "llama":
            return 3 * self.d_model * width
        return 2 * self.d_model * width + width + self.d_model

    def attention_params(self) -> int:
        """One block's attention: its matmuls, GPT's biases, Qwen3's QK-norms, MLA's latent norms."""
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        biases = 0 if self.arch == "llama" else self.n_heads * self.head_dim + d + 2 * kv
        norms = (2 * self.head_dim if self.qk_norm else 0) + self.q_lora_rank + self.kv_lora_rank
        return self.attention_matmul_params() + biases + norms

    def norm_params(self) -> int:
        return self.d_model * (1 if self.arch == "llama" else 2)


def param_counts(shape: MoEShape) -> dict[str, int]:
    """``total``, ``active`` (per token), ``expert`` (all experts) parameters, vocabulary unpadded."""
    s = MoEShape.of(shape)
    dense_block = s.attention_params() + 2 * s.norm_params()
    expert = s.mlp_params(s.expert_d_ff)
    shared = s.mlp_params(s.moe_shared_experts * s.expert_d_ff) if s.moe_shared_experts else 0
    moe_dense = s.moe_experts * s.d_model + shared  # router + shared experts
    embed = s.vocab_size * s.d_model * (1 if s.tie_embeddings else 2) + s.norm_params()
    if s.arch == "gpt":
        embed += s.seq_len * s.d_model
    dense_layers = s.n_layers - s.moe_layers
    base = embed + s.n_layers * dense_block + dense_layers * s.mlp_params(s.d_ff) + s.moe_layers * moe_dense
    experts = s.moe_layers * s.moe_experts * expert
    return {"total": base + experts, "active": base + s.moe_layers * s.moe_top_k * expert, "expert": experts}


def all_to_all_payload_bytes(shape: MoEShape, tokens: int, *, elem_bytes: int = 4, backward: bool = True) -> float:
    """All-to-all payload per rank for one micro-batch of ``tokens`` tokens through all MoE layers
    (dropless, ep > 1; module docstring)."""
    s = MoEShape.of(shape)
    rows = s.moe_top_k * tokens * s.d_model * elem_bytes
    per_layer = COUNT_BYTES * s.moe_experts + 2 * rows + (2 * rows if backward else 0)
    return s.moe_layers * per_layer


def flops_per_token(shape: MoEShape) -> float:
    """Training FLOPs per token: ``6 ·`` active parameters (embedding lookup excluded) + the attention
    core's ``6·L·s·H·(qk + v)`` (``12·L·d·s`` for plain heads; :meth:`ModelShape.attention_core_flops_per_token`)."""
    s = MoEShape.of(shape)
    active = param_counts(s)["active"] - (0 if s.tie_embeddings else s.vocab_size * s.d_model)
    return 6 * active + s.n_layers * s.attention_core_flops_per_token()


# ------------------------------------------------------------------ the planner's hooks (plan_layout)
def moe_shape(cfg) -> MoEShape | None:
    """The MoE view of a model config, or None for a dense model (``moe_experts`` absent or 0)."""
    return MoEShape.of(cfg) if getattr(cfg, "moe_experts", 0) else None


def check_ep(moe: MoEShape | None, dp: int, ep: int, sequence_parallel: bool = False, cp: int = 1) -> None:
    """Refuse what an MoE model's layers refuse, in their words: an ``ep`` dividing neither ``dp`` nor the
    experts, sequence or context parallelism with capacity-limited routing."""
    from ..dims import ep_mismatch
    from ..layers.moe import (
        CONTEXT_PARALLEL_CAPACITY_REFUSED,
        SEQUENCE_PARALLEL_CAPACITY_REFUSED,
        MoEConfig,
        MoEConfigError,
    )

    if dp % ep:
        raise PlanError(ep_mismatch(dp, ep))
    if moe is None:
        return
    try:
        MoEConfig(num_experts=moe.moe_experts, d_ff=moe.expert_d_ff, top_k=moe.moe_top_k).check(ep)
    except MoEConfigError as e:
        raise PlanError(str(e)) from None
    if sequence_parallel and moe.moe_layers and not sp_routes(moe):
        raise PlanError(SEQUENCE_PARALLEL_CAPACITY_REFUSED)
    if cp > 1 and moe.moe_layers and not cp_routes(moe):
        raise PlanError(CONTEXT_PARALLEL_CAPACITY_REFUSED)


def cp_routes(moe: MoEShape | None) -> bool:
    """Whether context parallelism can split this model's sequences (dense, or dropless MoE)."""
    return moe is None or not moe.moe_layers or moe.moe_capacity_factor is None


def sp_routes(moe: MoEShape | None) -> bool:
    """Whether sequence parallelism can split this model's sequences between its blocks: the same rule as
    context parallelism's (dense, or dropless MoE: :func:`check_ep`)."""
    return cp_routes(moe)


def ep_choices(moe: MoEShape | None, dp: int) -> list[int]:
    """The eps ``recommend`` tries: the divisors of ``dp`` that divide the experts (1 for a dense model)."""
    if moe is None:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and moe.moe_experts % e == 0]


def moe_layers_in(moe: MoEShape | None, layers: range) -> int:
    """How many of ``layers`` (global indices) are MoE blocks (``models.config.ModelConfig.is_moe_layer``)."""
    return 0 if moe is None else sum(1 for i in layers if moe.is_moe_layer(i))


def bias_load_traffic(moe: MoEShape | None, axis, hw, *, n_moe: int) -> float:
    """Aux-loss-free balancing's one all-reduce per step of the stage's ``[n_moe, E]`` int64 expert loads
    (:func:`parallel.layers.moe.update_router_bias_`, after the optimizer step: nothing hides it) over
    ``axis``; returns its seconds. Nothing without a bias update rate or MoE blocks."""
    if moe is None or not moe.moe_bias_update_rate or n_moe == 0:
        return 0.0
    return axis.add("all_reduce", COUNT_BYTES * moe.moe_experts * n_moe, 1, hw, "expert loads for the bias (int64)")


def ep_split(params, ep: int):
    """``(dense, experts)``: a rank's :class:`~parallel.plan.memory.StageParams` at ``ep`` (counted at
    ep = 1), split into what ZeRO shards over dp·cp and the ``E/ep`` experts it shards over edp."""
    from .memory import StageParams

    x = params.expert
    if x % ep:
        raise PlanError(f"ep={ep} does not divide this rank's {x} expert parameters")
    dense = StageParams(
        params.numel - x,
        params.replicated - x,
        params.full - x,
        params.tied_copy,
        params.shared_embedding,
        blocks=params.blocks,
        root=params.root,
    )
    blocks = tuple(tuple(tuple(n // ep for n in g) for g in unit) for unit in params.expert_blocks)
    experts = StageParams(x // ep, x // ep, x // ep, blocks=blocks, expert=x // ep, expert_blocks=blocks)
    return dense, experts


def at_ep(params, ep: int):
    """``params`` as one rank holds them at ``ep`` (its ``E/ep`` experts)."""
    dense, experts = ep_split(params, ep)
    return dense + experts


def layer_time(moe: MoEShape, dense, local, micro_batch: int, tp: int, hw, precision: str, routed: int | None = None):
    """One MoE block's :class:`~parallel.plan.compute.LayerTime`: the dense block's with its MLP replaced by the
    router, the shared experts (TP-split) and ``k·R`` rows through one expert (not TP-split, balanced); ``R``
    (``routed``) the tokens a rank routes: ``T = micro_batch·local.seq_len``, or ``T/tp`` under sequence
    parallelism (``ParallelDims.tp_seq_len``)."""
    from dataclasses import replace

    from .compute import gemm_seconds

    e = 4 if precision == "fp32" else 2
    T, d, t = micro_batch * local.seq_len, local.d_model, tp
    R = T if routed is None else routed
    mats = 2 if moe.arch == "llama" else 1  # SwiGLU: gate and up

    def mlp(rows, width, split):
        return gemm_seconds(rows, d, mats * width / split, hw, precision) + gemm_seconds(
            rows, width / split, d, hw, precision
        )

    def act(rows, width, split):
        return e * rows * width * (mats + 1) / split / hw.hbm_bytes_per_s

    f, shared, rows = moe.expert_d_ff, moe.moe_shared_experts * moe.expert_d_ff, moe.moe_top_k * R
    gemm = dense.gemm - mlp(T, local.d_ff, t) + gemm_seconds(R, d, moe.moe_experts, hw, precision) + mlp(rows, f, 1)
    gemm += mlp(T, shared, t) if shared else 0.0
    ew = dense.elementwise - act(T, local.d_ff, t) + act(rows, f, 1) + (act(T, shared, t) if shared else 0.0)
    return replace(dense, gemm=gemm, elementwise=ew)


def activation_bytes(
    moe: MoEShape,
    local,
    micro_batch: int,
    *,
    tp: int,
    checkpointing: str,
    e: int,
    ep: int,
    routed: int | None = None,
    compiled: bool = False,
):
    """What an MoE block saves beyond the dense block, less the dense MLP's (:func:`.memory.mlp_activation_bytes`,
    both ``compiled`` or not); nothing under full recomputation. ``routed``: the ``R`` tokens a rank routes
    (:func:`layer_time`; default all ``T = micro_batch·local.seq_len``), ``k·R`` rows through the experts
    (balanced, nothing dropped).

    Dispatch and combine run eager either way (:meth:`parallel.layers.moe.MoELayer.forward`) and keep the
    experts' input rows, their outputs back at this rank and the weighted outputs (the index-add's source),
    the sort order and token indices (int64) and the weights in the compute dtype; the experts the int32
    offsets of their ``E/ep`` segments; at ep > 1 also the regrouping permutation and its inverse (int64, read by
    two index selects), while the rows sent and received by the all-to-alls are not saved (the experts keep
    the regrouped copy): read from the code, not measured (the rest is, at ep = 1: docs/planner.md). SwiGLU experts and shared experts keep gate, up and their product, and eager
    ``silu(gate)`` too.

    The router, eager: the fp32 logits (the z-loss's log-sum-exp input) and the softmax or sigmoid scores,
    the top-k indices (int64), the log-sum-exp, the ``2E + 1`` statistics and the ``E`` load fractions of
    the balance loss (fp32); renormalised top-k weights keep the weights and their sum (fp32), sigmoid
    scores also their sum over the experts. ``compiled`` (the router a graph of its own): its logits in the
    compute dtype, the top-k indices and fp32 weights, the fp32 log-sum-exp, the ``2E + 1`` statistics and
    (sigmoid scores) the fp32 scores and their top-k sum; which of these the partitioner keeps is its
    min-cut's choice. DeepSeek-V3's sequence-wise loss keeps ``O(E)`` floats per sequence more: not priced."""
    if checkpointing == "full":
        return 0.0
    from .memory import mlp_activation_bytes

    T, d, k, E = micro_batch * local.seq_len, local.d_model, moe.moe_top_k, moe.moe_experts
    R = T if routed is None else routed
    rows = k * R
    sigmoid = moe.moe_score == "sigmoid"
    dense_mlp = mlp_activation_bytes(moe.arch, T, local.d_ff / tp, e, compiled)
    shared = mlp_activation_bytes(moe.arch, T, moe.moe_shared_experts * moe.expert_d_ff / tp, e, compiled)
    experts = mlp_activation_bytes(moe.arch, rows, moe.expert_d_ff, e, compiled)
    combine = 3 * e * rows * d + (16 + e) * rows + 4 * (E // ep) + (16 * rows if ep > 1 else 0)
    stats = 4 * (2 * E + 1)
    if compiled:
        router = e * R * E + 12 * R * k + 4 * R + stats + (4 * R * E + 4 * R if sigmoid else 0)
    else:
        normalised = 4 * R * k + 4 * R if moe.moe_normalize_top_k else 0
        router = 8 * R * E + 8 * R * k + 4 * R + stats + 4 * E + normalised + (4 * R if sigmoid else 0)
    return router + experts + combine + shared - dense_mlp


def ep_traffic(moe: MoEShape, axis, hw, *, n_moe: int, tokens: int, m: int, e: int, checkpointing: str):
    """The ep group's all-to-alls of ``n_moe`` MoE blocks over ``m`` micro-batches (``axis`` accumulates
    the bytes); returns the seconds per micro-batch (forward, backward), exposed: the layer waits for them."""
    if axis.group_size == 1 or n_moe == 0:
        return 0.0, 0.0
    rows = moe.moe_top_k * tokens * moe.d_model * e
    again = 2 if checkpointing == "full" else 1
    c = axis.add("all_to_all", COUNT_BYTES * moe.moe_experts, again * n_moe * m, hw, "expert counts (int64)")
    r = axis.add("all_to_all", rows, again * 2 * n_moe * m, hw, "routed rows out and back (forward)")
    b = axis.add("all_to_all", rows, 2 * n_moe * m, hw, "routed row gradients back and out (backward)")
    fwd = n_moe * (c + 2 * r)
    return fwd, 2 * n_moe * b + (fwd if again == 2 else 0.0)


#: bytes of one router-statistics element the MoE layer sums over cp and SP's tp (fp32 sums and counts)
STATS_BYTES = 4


def stats_traffic(
    moe: MoEShape, axis, hw, *, n_moe: int, m: int, checkpointing: str, backward: bool = True, sequences: int = 0
) -> tuple[float, float]:
    """The all-reduces of ``n_moe`` MoE blocks' router statistics over ``axis`` (``router_stats_numel``
    fp32 sums, again under full recomputation; ``backward``: their gradient too, as over cp; over tp under
    sequence parallelism the backward is identity); ``sequences``: with the sequence-wise aux loss on, the
    micro-batch's sequences, whose ``sequence_stats_numel`` sums each block also all-reduces (over tp under
    SP, backward identity; refused under cp); returns the exposed seconds per micro-batch (forward, backward)."""
    from ..layers.moe import router_stats_numel, sequence_stats_numel

    if axis.group_size == 1 or n_moe == 0:
        return 0.0, 0.0
    payload, again = router_stats_numel(moe.moe_experts) * STATS_BYTES, 2 if checkpointing == "full" else 1
    f = axis.add("all_reduce", payload, again * n_moe * m, hw, "MoE router statistics (forward)")
    b = axis.add("all_reduce", payload, n_moe * m, hw, "MoE router statistics' gradient (backward)") if backward else 0
    if sequences and moe.moe_seq_aux_loss_weight:
        seq = sequence_stats_numel(moe.moe_experts, sequences) * STATS_BYTES
        f += axis.add("all_reduce", seq, again * n_moe * m, hw, "MoE per-sequence statistics (forward)")
    return n_moe * f, n_moe * (b + (f if again == 2 else 0.0))
