"""The planner's view of a mixture-of-experts model: parameters, memory, all-to-all traffic, FLOPs.

Pure functions of :class:`MoEShape` (read from any config with ``ModelConfig``'s ``moe_*`` fields,
so ``parallel.plan`` never imports ``models``). The numbers follow :mod:`parallel.layers.moe`:

* **Parameters.** An MoE block holds ``E`` experts of ``m·d·f`` weights (``m`` = 3 for SwiGLU,
  2 for GELU, + ``f + d`` biases for GELU) and a router ``E·d``; a token uses ``k`` of them (and
  the shared experts): *active* parameters are the dense ones + ``k`` experts per MoE block.
* **Memory.** Expert parameters are split over ``ep`` (``E / ep`` per rank) and their ZeRO
  states over ``edp`` (= ``dp / ep``), dense ones over ``dp`` as before.
* **All-to-all.** Per MoE layer and micro-batch of ``T`` tokens per rank, dropless: forward one
  exchange of the per-expert counts (``8·E`` bytes, int64), the routed rows out (``k·T·d`` elements)
  and back (``k·T·d``); backward the two row exchanges again. Payload per rank averaged over the
  ep group (exact for the sum over it: each row leaves and returns once); a rank sends
  ``(ep-1)/ep`` of it under balanced routing.
* **FLOPs.** ``6 ×`` active parameters per token (the dense 6·N rule applied to what a token
  touches) + attention's ``12·L·d·s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import PlanError

#: the count exchange's element: int64 (parallel.layers.moe exchanges int64 counts)
COUNT_BYTES = 8


@dataclass(frozen=True)
class MoEShape:
    """What the planner needs of an MoE decoder (a ``ModelConfig`` with ``moe_experts > 0``)."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool
    moe_experts: int
    moe_top_k: int
    moe_every: int = 1
    moe_d_ff: int | None = None
    moe_shared_experts: int = 0

    @classmethod
    def of(cls, cfg) -> MoEShape:
        return cfg if isinstance(cfg, cls) else cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.n_layers) if self.moe_experts and (i + 1) % self.moe_every == 0)

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    def mlp_params(self, width: int) -> int:
        """One MLP / expert of hidden ``width`` (SwiGLU without biases for llama, GELU with)."""
        if self.arch == "llama":
            return 3 * self.d_model * width
        return 2 * self.d_model * width + width + self.d_model

    def attention_params(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * (self.d_model // self.n_heads)
        biases = 0 if self.arch == "llama" else 2 * d + 2 * kv
        return 2 * d * d + 2 * d * kv + biases

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


def expert_params_per_rank(shape: MoEShape, ep: int, pp: int = 1) -> float:
    """Expert parameters one rank holds (``E / ep`` experts of its ``1/pp`` share of the MoE layers)."""
    s = MoEShape.of(shape)
    if s.moe_experts % ep:
        raise PlanError(f"ep={ep} does not divide moe_experts={s.moe_experts}")
    return param_counts(s)["expert"] / ep / pp


def expert_state_bytes_per_rank(
    shape: MoEShape, *, ep: int, dp: int, pp: int = 1, zero: int = 1, param_bytes: int = 2
) -> float:
    """Bytes of expert weights + fp32 gradient + AdamW master and moments on one rank: weights in
    ``param_bytes`` (sharded over edp at ZeRO-3), gradients (ZeRO ≥ 2) and the 12 bytes of optimizer
    state (ZeRO ≥ 1) sharded over ``edp = dp / ep``."""
    if dp % ep:
        raise PlanError(f"ep={ep} must divide dp={dp}")
    n, edp = expert_params_per_rank(shape, ep, pp), dp // ep
    weights = n * param_bytes / (edp if zero >= 3 else 1)
    grads = n * 4 / (edp if zero >= 2 else 1)
    states = n * 12 / (edp if zero >= 1 else 1)
    return weights + grads + states


def all_to_all_payload_bytes(shape: MoEShape, tokens: int, *, elem_bytes: int = 4, backward: bool = True) -> float:
    """All-to-all payload per rank for one micro-batch of ``tokens`` tokens through all MoE layers
    of the model (dropless; see the module docstring). Zero when ep = 1 (no exchange) is the
    caller's business: this is the ep > 1 figure."""
    s = MoEShape.of(shape)
    rows = s.moe_top_k * tokens * s.d_model * elem_bytes
    per_layer = COUNT_BYTES * s.moe_experts + 2 * rows + (2 * rows if backward else 0)
    return s.moe_layers * per_layer


def all_to_all_seconds(payload_bytes: float, ep: int, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``payload_bytes`` of all-to-all over ``ep`` ranks at ``bandwidth`` per rank:
    each rank sends ``(ep-1)/ep`` of it (bandwidth term only, no latency)."""
    return 0.0 if ep == 1 else payload_bytes * (ep - 1) / ep / bandwidth_bytes_per_s


def flops_per_token(shape: MoEShape) -> float:
    """Training FLOPs per token: ``6 ·`` active parameters (embedding lookup excluded, head
    included) + ``12·L·d·s`` for attention."""
    s = MoEShape.of(shape)
    active = param_counts(s)["active"] - (0 if s.tie_embeddings else s.vocab_size * s.d_model)
    return 6 * active + 12 * s.n_layers * s.d_model * s.seq_len
