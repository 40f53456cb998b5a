"""``train.compile``'s per-block compile (parallel/compile.py): no graph breaks at the parallel
layouts, the same numbers as eager, the same bytes counted, and recompiles bounded by shapes."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

from parallel import comm
from parallel.compile import compile_stats
from parallel.layers import DocumentMask, cp_slice
from parallel.layers.fp8 import Fp8Recipe
from parallel.layers.linear import enable_fp8
from parallel.testing import run_ranks

# name: (preset, build_model keywords made from the 2-rank group, local sequence, backend). aot_eager
# (forward and backward traced, as inductor sees them) where the graph passes matter: sequence
# parallelism's re-gather, the ring's output strides; dynamo alone (cheaper) elsewhere
LAYOUTS = {
    "tp": ("gpt_tiny", lambda g: dict(tp_group=g), 16, "eager"),
    "tp_sp": ("llama_tiny", lambda g: dict(tp_group=g, sequence_parallel=True), 8, "aot_eager"),
    "cp_ring": ("llama_tiny", lambda g: dict(cp_group=g, cp_impl="ring"), 8, "aot_eager"),
    "cp_alltoall": ("llama_tiny", lambda g: dict(cp_group=g, cp_impl="alltoall"), 8, "eager"),
    "ep_moe": ("mixtral_tiny", lambda g: dict(ep_group=g), 16, "eager"),  # regions: tests/models/test_compile_moe.py
    "tp_selective": ("gpt_tiny", lambda g: dict(tp_group=g), 16, "eager"),  # attention cores recomputed
    # fp8 (emulated): the amax all-reduces, the fp8 all-gathers and the reduce-scatter as traceable ops
    "tp_sp_fp8_tensorwise": ("llama_tiny", lambda g: dict(tp_group=g, sequence_parallel=True), 8, "aot_eager"),
    "tp_fp8_rowwise": ("gpt_tiny", lambda g: dict(tp_group=g), 16, "aot_eager"),
    # packed documents: the mask built before the block, read inside it (selective: a checkpointed core)
    "tp_documents": ("llama_tiny", lambda g: dict(tp_group=g), 16, "aot_eager"),
    "cp_ring_documents": ("llama_tiny", lambda g: dict(cp_group=g, cp_impl="ring"), 8, "aot_eager"),
    "cp_alltoall_documents": ("llama_tiny", lambda g: dict(cp_group=g, cp_impl="alltoall"), 8, "aot_eager"),
}


def _block_step(layout: str, compiled: bool):
    """One block's forward + backward on this rank: (output, input grad, weight grads, bytes by op)."""
    from models.compiled import compile_block, compile_stage
    from models.config import preset
    from models.transformer import build_model

    name, kwargs, seq, backend = LAYOUTS[layout]
    group = dist.new_group([0, 1], group_desc="tp")
    cfg = preset(name, n_layers=1, seq_len=16, d_model=64)
    if layout in ("tp_selective", "tp_documents"):
        cfg = cfg.replace(activation_checkpointing="selective")
    stage = build_model(cfg, seed=3, **kwargs(group))
    block = stage.blocks["0"]
    if "fp8" in layout:
        enable_fp8(block.modules(), Fp8Recipe(layout.rsplit("_", 1)[1], emulate=True))
    documents = None
    if "documents" in layout:  # three documents in each window of 16, the mask prepared as the stage does
        window = torch.cat([torch.arange(5), torch.arange(4), torch.arange(7)]).repeat(2, 1)
        cp = 2 if layout.startswith("cp") else 1
        documents = DocumentMask(window, cp_slice(window, cp, dist.get_rank() if cp > 1 else 0))
        if "ring" not in layout:
            documents.prepare("sdpa")
    if compiled and layout == "tp":  # the block and the vocabulary-parallel loss (its two all-reduces)
        compile_stage(stage, backend)
    elif compiled:
        compile_block(block, backend)
    x = torch.randn(2, seq, cfg.d_model, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_(True)
    with comm.CommCounter() as counter:
        out = block(x, documents)
        loss = (out * out).sum()
        if layout == "tp":
            loss = loss + stage.loss(stage._head(out), torch.arange(2 * seq).view(2, seq) % cfg.vocab_size)
        loss.backward()
    grads = [p.grad for p in block.parameters()]
    bytes_ = {
        op: counter.sent_bytes(op=op) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
    }
    return out.detach(), x.grad, grads, bytes_


def _compare_all():
    """Every layout eager and compiled on this rank; returns per layout the largest difference,
    whether the bytes match, and the graph breaks it added."""
    torch.manual_seed(0)
    out = {}
    for layout in LAYOUTS:
        torch._dynamo.reset()  # each layout compiles the one TransformerBlock.forward afresh (recompile limit 8)
        before = compile_stats()["graph_breaks"]
        eager = _block_step(layout, compiled=False)
        comp = _block_step(layout, compiled=True)
        diff = max(
            (a - b).abs().max().item() for a, b in zip([eager[0], eager[1], *eager[2]], [comp[0], comp[1], *comp[2]])
        )
        out[layout] = (diff, eager[3] == comp[3] and any(eager[3].values()), compile_stats()["graph_breaks"] - before)
    return out


@pytest.fixture(scope="module")
def compared():
    return run_ranks(_compare_all, 2, timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_compiles_without_breaks_same_numbers_same_bytes(compared, layout):
    for rank in compared:
        diff, same_bytes, breaks = rank[layout]
        assert breaks == 0
        assert diff <= 1e-6, f"{layout}: compiled differs from eager by {diff:.2e}"
        assert same_bytes, f"{layout}: the compiled block's counted bytes differ from eager's"


def test_recompiles_one_per_shape_and_grad_mode():
    """A short last micro-batch and evaluation (no grad) compile once each, then never again."""
    import torch._dynamo

    from models.compiled import compile_stage
    from models.config import preset
    from models.transformer import build_model

    torch._dynamo.reset()
    cfg = preset("gpt_tiny", n_layers=2, d_model=32, seq_len=16)
    stage = build_model(cfg)
    compile_stage(stage, "eager")
    full, short = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (1, 16))
    graphs = []
    for _ in range(3):  # steps: two micro-batches (one short), then an evaluation
        for ids in (full, short):
            stage.loss(stage(ids), ids).backward()
        with torch.no_grad():
            stage.loss(stage(full), full)
        graphs.append(compile_stats()["graphs"])
    # block and loss, each at batch 2 and 1 with grad and batch 2 without: 6, both blocks sharing
    assert graphs == [6, 6, 6]
