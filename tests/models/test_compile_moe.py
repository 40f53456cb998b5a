"""``train.compile`` of a mixture-of-experts block (models/compiled.py, parallel/compile.py: compile_moe):
the router, the routed experts (row count symbolic) and the shared experts compiled as regions, the
dispatch and combine eager between them. Compiled against eager over several steps whose expert loads
differ: the same numbers, the same bytes op by op, no graph break, and graphs bounded, not one per load."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

from parallel import comm
from parallel.compile import compile_stats
from parallel.layers import MoELayer
from parallel.layers.moe import update_router_bias_
from parallel.testing import run_ranks

STEPS = 4
# name: (preset, overrides). deepseek: sigmoid scores + selection bias (moved between steps), group-limited
# choice, shared experts, MLA, the sequence-wise loss; capacity: drops, so the experts' row count varies at ep=1
CASES = {
    "mixtral": ("mixtral_tiny", dict(moe_z_loss_weight=1e-3)),
    "deepseek": ("deepseek_tiny", dict(moe_seq_aux_loss_weight=1e-3)),
    "mixtral_capacity": ("mixtral_tiny", dict(moe_capacity_factor=1.0)),
}


def _moe_block(case: str, group_kw: dict):
    from models.config import preset
    from models.transformer import build_model

    name, overrides = CASES[case]
    cfg = preset(name, n_layers=2, seq_len=16, **overrides)
    stage = build_model(cfg, seed=3, **group_kw)
    block = next(b for b in stage.blocks.values() if isinstance(b.mlp, MoELayer))
    if block.mlp.e_score_correction_bias is not None:  # a selection bias that matters
        bias = torch.randn(cfg.moe_experts, generator=torch.Generator().manual_seed(7))
        block.mlp.e_score_correction_bias.copy_(0.05 * bias)
    return block, cfg


def moe_steps(
    case: str, compiled: bool, backend: str = "aot_eager", group_kw=None, steps: int = STEPS, biases=None
) -> dict:
    """``steps`` forward + backward passes of one MoE block on fresh inputs (this rank's): per step the
    output, input gradient and weight gradients; the bytes counted per (group, op); the rows the experts
    received per call; each step's load per expert; graphs and graph breaks compiled after each step.
    ``biases``: the selection bias to set before each step (else it moves by aux-loss-free balancing)."""
    from models.compiled import compile_block

    group_kw = group_kw or {}
    block, cfg = _moe_block(case, group_kw)
    if compiled:
        assert compile_block(block, backend) == "moe"
    experts, rows = block.mlp.experts, []
    grouped = experts.grouped
    experts.grouped = lambda x, *a: rows.append(x.shape[0]) or grouped(x, *a)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sp = 2 if group_kw.get("sequence_parallel") else 1
    start = compile_stats()
    tensors, graphs, breaks, loads = [], [], [], []
    with comm.CommCounter() as counter:
        for step in range(steps):
            if biases is not None:
                block.mlp.e_score_correction_bias.copy_(biases[step])
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(2, 16 // sp, cfg.d_model, generator=gen, requires_grad=True)
            out = block(x)
            (out * out).sum().backward()
            tensors.append([out.detach(), x.grad, *(p.grad for p in block.parameters())])
            loads.append(block.mlp.last_stats["tokens_per_expert"].tolist())
            block.zero_grad(set_to_none=True)
            update_router_bias_(block)  # deepseek: the bias moves in place between steps
            stats = compile_stats()
            graphs.append(stats["graphs"] - start["graphs"])
            breaks.append(stats["graph_breaks"] - start["graph_breaks"])
    counted = {key: (s.calls, s.payload_bytes, s.sent_bytes) for key, s in counter.stats.items()}
    return dict(tensors=tensors, bytes=counted, rows=rows, graphs=graphs, breaks=breaks, loads=loads)


def compare(case: str, backend: str, group_kw=None, **kw) -> dict:
    """Eager against compiled (``backend``): the largest difference over every step's tensors, whether the
    counted bytes match, and the compiled run's rows, loads, graphs and breaks (``kw``: to :func:`moe_steps`)."""
    torch._dynamo.reset()
    eager = moe_steps(case, False, group_kw=group_kw, **kw)
    comp = moe_steps(case, True, backend, group_kw=group_kw, **kw)
    diff = max((a - b).abs().max().item() for e, c in zip(eager["tensors"], comp["tensors"]) for a, b in zip(e, c))
    assert len(eager["tensors"][0]) == len(comp["tensors"][0])
    return dict(diff=diff, same_bytes=eager["bytes"] == comp["bytes"], bytes=comp["bytes"], rows=comp["rows"],
                graphs=comp["graphs"], breaks=comp["breaks"], eager_rows=eager["rows"], loads=comp["loads"],
                tensors=comp["tensors"])  # fmt: skip


def _check(got: dict, tolerance: float, regions: int, what: str) -> None:
    assert got["breaks"][-1] == 0, f"{what}: {got['breaks']} graph breaks"
    assert got["diff"] <= tolerance, f"{what}: compiled differs from eager by {got['diff']:.2e}"
    assert got["same_bytes"], f"{what}: the compiled block's counted bytes differ from eager's"
    assert got["rows"] == got["eager_rows"]
    # every region compiles on the first step; later loads add at most the variant whose weight gradients
    # zero an expert that got no rows (a flag), never a graph per row count
    assert regions <= got["graphs"][0] <= got["graphs"][-1] <= regions + 1, f"{what}: graphs {got['graphs']}"


# regions of a block: attention half (with the MLP norm), router, routed experts (+ shared experts)
REGIONS = {"mixtral": 3, "deepseek": 4, "mixtral_capacity": 3}


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_aot_eager_is_bit_identical_without_breaks(case):
    got = compare(case, "aot_eager")
    _check(got, 0.0, REGIONS[case], case)
    if case == "mixtral_capacity":  # drops: the experts' row count changed from step to step
        assert len(set(got["rows"])) > 2, got["rows"]


@pytest.mark.parametrize("case", ["mixtral", "deepseek"])
def test_one_process_inductor_matches_eager(case):
    got = compare(case, "inductor")
    _check(got, 1e-6, REGIONS[case], case)


def test_the_compiled_router_reads_the_bias_as_it_moves_and_empty_experts_get_zero_gradients():
    """The selection bias is a buffer the graph reads, not a constant baked in: moved to favour experts 0-2,
    then 3-5, the compiled router follows; the experts left without rows have zero weight gradients
    (the zeroing inside the compiled experts), as in eager — and neither load compiles a graph of its own."""
    favour = [torch.tensor([10.0 if e // 3 == half else -10.0 for e in range(6)]) for half in (0, 1)]
    got = compare("deepseek", "aot_eager", steps=2, biases=favour)
    _check(got, 0.0, REGIONS["deepseek"], "deepseek, all tokens on half the experts")
    assert got["loads"] == [[32, 32, 32, 0, 0, 0], [0, 0, 0, 32, 32, 32]]
    block, _ = _moe_block("deepseek", {})
    names = ["out", "x.grad", *(name for name, _ in block.named_parameters())]
    for step, tensors in enumerate(got["tensors"]):
        grads = dict(zip(names, tensors))
        for weight in ("gate_proj", "up_proj", "down_proj"):
            grad = grads[f"mlp.experts.{weight}"]
            assert torch.count_nonzero(grad[3 - 3 * step : 6 - 3 * step]) == 0
            assert torch.count_nonzero(grad[3 * step : 3 * step + 3]) > 0


# 2 ranks: name: (case, build_model keywords from the 2-rank group). ep: each rank routes its own tokens to
# the 4 (6) experts split over both ranks (dp=2 × ep=2), the received rows varying; tp_sp: the router's
# statistics summed over tp inside the compiled router, the shared experts' gather and reduce-scatter traced
LAYOUTS = {
    "ep_mixtral": ("mixtral", lambda g: dict(ep_group=g)),
    "ep_deepseek": ("deepseek", lambda g: dict(ep_group=g)),
    "ep_capacity": ("mixtral_capacity", lambda g: dict(ep_group=g)),
    "tp_sp_deepseek": ("deepseek", lambda g: dict(tp_group=g, sequence_parallel=True)),
}


def _compare_layouts():
    torch.manual_seed(0)
    group = dist.new_group([0, 1])
    return {name: compare(case, "aot_eager", make(group)) for name, (case, make) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_compare_layouts, 2, timeout=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_aot_eager_same_numbers_same_bytes_bounded_graphs(two_ranks, layout):
    case = LAYOUTS[layout][0]
    for rank in two_ranks:
        got = rank[layout]
        _check(got, 0.0, REGIONS[case], layout)
        ops = {op for _, op in got["bytes"]}
        assert ("all_to_all" in ops) == layout.startswith("ep"), got["bytes"]
        assert ("all_reduce" in ops or "reduce_scatter" in ops) == layout.startswith("tp"), got["bytes"]
    if layout.startswith("ep"):  # what an expert rank receives follows the routing: it varied
        assert len({n for rank in two_ranks for n in rank[layout]["rows"]}) > 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("case", ["deepseek", "mixtral_capacity"])  # two inductor compiles: gpu_check's step 1 budget
def test_cuda_bf16_inductor_moe_block_matches_eager(case):
    """On a GPU in bf16 the experts trace through torch's own grouped op (inductor's lowering of it), not
    the fp32 stand-in: over steps whose expert loads differ (capacity: the row count too), the compiled
    block runs its compiled experts region, breaks no graph, and stays within bf16's rounding of eager.
    deepseek's experts get a width the grouped kernel takes (16-byte aligned rows: ``moe_d_ff=16``)."""
    from models.compiled import compile_block

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        block, cfg = _moe_block(case, {})
        if case == "deepseek":
            block, cfg = _moe_block_sized(cfg.replace(moe_d_ff=16))
        bias = block.mlp.e_score_correction_bias
        block = block.to("cuda", torch.bfloat16)
        if bias is not None:  # the selection bias stays fp32, as the trainer keeps it
            block.mlp.e_score_correction_bias = bias.to("cuda")
        if compiled:
            assert compile_block(block, "inductor") == "moe"
        experts, calls = block.mlp.experts, []
        grouped = experts.grouped
        experts.grouped = lambda x, *a: calls.append(x.shape[0]) or grouped(x, *a)
        start, outs = compile_stats(), []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(2, 16, cfg.d_model, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
            out = block(x)
            (out.float() ** 2).sum().backward()
            outs += [out.float(), x.grad.float(), *(p.grad.float() for p in block.parameters() if p.grad is not None)]
            block.zero_grad(set_to_none=True)
        assert calls, f"{case}: the experts' grouped region never ran (the loop fallback took the rows)"
        runs.append(outs)
    assert compile_stats()["graph_breaks"] == start["graph_breaks"]
    assert len(runs[0]) == len(runs[1])
    for e, c in zip(*runs):
        assert torch.allclose(e, c, rtol=3e-2, atol=3e-2 * e.abs().max().item()), (e - c).abs().max()


def _moe_block_sized(cfg):
    from models.transformer import build_model

    stage = build_model(cfg, seed=3)
    return next(b for b in stage.blocks.values() if isinstance(b.mlp, MoELayer)), cfg
