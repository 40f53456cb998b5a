"""torchtitan's per-block compile for :mod:`models.transformer` stages (``train.compile``, docs/compile.md)."""

from __future__ import annotations

from parallel.compile import compile_method, compile_moe
from parallel.layers import MoELayer

from .transformer import TransformerBlock, TransformerStage


def compile_block(block: TransformerBlock, backend: str = "inductor") -> str:
    """Compile ``block`` in place (:func:`parallel.compile.compile_method`): its whole forward (``"block"``),
    or, for a mixture of experts (``"moe"``), its regions: the attention half with the MLP's norm and the
    MoE layer's router, routed experts and shared experts (:func:`parallel.compile.compile_moe`); the
    dispatch and combine between them, sized by token counts read on the host, and the residual add
    stay eager. Returns what was compiled."""
    if isinstance(block.mlp, MoELayer):
        compile_method(block, "attention_half", backend=backend)
        compile_moe(block.mlp, backend)
        return "moe"
    compile_method(block, "forward", backend=backend)
    return "block"


def compile_stage(stage: TransformerStage, backend: str = "inductor") -> dict[str, int]:
    """Every block of ``stage`` (:func:`compile_block`) and, on the stage with the head, the loss; the
    stage's own forward (embedding, the loop over blocks, checkpointing, head) stays eager. Returns how
    many regions of each kind."""
    kinds: dict[str, int] = {}
    for block in stage.blocks.values():
        kind = compile_block(block, backend)
        kinds[kind] = kinds.get(kind, 0) + 1
    if stage.has_head:
        compile_method(stage, "loss", backend=backend)
        kinds["loss"] = 1
    return kinds
