"""The planner's ``train.compile``: what a compiled block saves for backward (inductor's partitioner),
measured with autograd's saved tensors against :func:`layer_activation_bytes` at ``compiled=True``, and
the fused elementwise bytes against the bytes of the kernels inductor generates for a block's forward."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from models.compiled import compile_block, compile_stage
from models.config import preset
from models.transformer import build_model
from parallel.plan import moe as plan_moe
from parallel.plan.compute import elementwise_bytes
from parallel.plan.memory import PRECISION_BYTES, layer_activation_bytes, stage_activation_bytes
from parallel.plan.shape import ModelShape
from parallel.testing import run_ranks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
B, S, D = 2, 16, 64  # micro-batch, sequence, d_model


def _saved(fn, params) -> int:
    """Bytes autograd saves while ``fn`` runs its forward (then its backward), one count per storage;
    parameters and the CPU generator's state (a checkpointed region's, host memory on a GPU) left out."""
    rng = torch.get_rng_state().numel()
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        rng_state = t.dtype == torch.uint8 and t.numel() == rng
        if not isinstance(t, nn.Parameter) and storage.data_ptr() not in params and not rng_state:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.float().sum().backward()
    return sum(seen.values())


# DeepSeek's latent attention with v as wide as q·k (torch's fused CPU kernel runs, as test_deepseek_plan's),
# dense (moe_experts=0) or one MoE block whose experts' rows are 16-byte aligned in bf16 (the grouped region)
VARIANTS = {
    "mla": ("deepseek_tiny", dict(moe_experts=0, v_head_dim=12)),
    "mla_no_q_lora": ("deepseek_tiny", dict(moe_experts=0, v_head_dim=12, q_lora_rank=0)),
    "deepseek_moe": ("deepseek_tiny", dict(moe_first_dense=0, v_head_dim=12, moe_d_ff=16)),
    "mixtral_moe": ("mixtral_tiny", {}),
}


def _cfg(name: str, **kw):
    name, overrides = VARIANTS.get(name, (name, {}))
    return preset(name, n_layers=1, seq_len=S, d_model=D, **overrides, **kw)


def _block_saved(name: str, ckpt: str, precision: str, compiled: bool, sp: bool = False) -> int:
    """One block's saved bytes on this rank (tp = the world, sequence-parallel if ``sp``), the second call
    (the first compiles)."""
    torch._dynamo.reset()
    tp = dist.get_world_size() if dist.is_initialized() else 1
    group = dist.new_group(list(range(tp))) if tp > 1 else None
    cfg = _cfg(name, activation_checkpointing=ckpt)
    block = build_model(cfg, seed=3, dtype=DTYPES[precision], tp_group=group, sequence_parallel=sp).blocks["0"]
    if compiled:
        compile_block(block, "inductor")
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(B, S // (tp if sp else 1), D, dtype=DTYPES[precision], requires_grad=True)
    _saved(lambda: block(x), params)
    return _saved(lambda: block(x), params)


def _planned(name: str, ckpt: str, precision: str, compiled: bool, tp: int = 1, sp: bool = False) -> float:
    """The plan's bytes for that block: the dense layer's, plus an MoE block's own (at tp = 1, ep = 1)."""
    cfg = _cfg(name)
    kw = dict(tp=tp, sequence_parallel=sp, checkpointing=ckpt, precision=precision)
    dense = layer_activation_bytes(cfg, B, compiled=compiled, **kw)
    moe, e = plan_moe.moe_shape(cfg), PRECISION_BYTES[precision]
    if moe is None:
        return dense
    return dense + plan_moe.activation_bytes(moe, cfg, B, tp=tp, checkpointing=ckpt, e=e, ep=1, compiled=compiled)


# LayerNorm's CPU kernel keeps its statistics in the input's dtype (fp32 on a GPU): GPT in fp32
CASES = [("gpt_tiny", "fp32"), ("llama_tiny", "bf16")]


@pytest.mark.parametrize("name, precision", CASES)
@pytest.mark.parametrize("ckpt", ["none", "selective"])
def test_compiled_block_saves_what_the_planner_says(name, precision, ckpt):
    measured = run_ranks(_block_saved, 1, name, ckpt, precision, True, timeout=300)[0]
    assert measured == _planned(name, ckpt, precision, compiled=True)


@pytest.mark.parametrize("name", ["mla", "mla_no_q_lora", "deepseek_moe", "mixtral_moe"])
@pytest.mark.parametrize("ckpt", ["none", "selective"])
def test_compiled_latent_attention_and_moe_blocks_save_what_the_planner_says(name, ckpt):
    """MLA's latent norms under RMSNorm's compiled rule; an MoE block's regions (router, experts, shared
    experts) and its eager dispatch and combine (docs/planner.md's table): exact, and less than eager.
    Eager too, exact but for llama attention's RoPE cos/sin tables without recomputation (outside the
    formula, docs/planner.md; MLA's ``4·rope`` per token stands for them, equal at micro-batch 2)."""
    measured = run_ranks(_block_saved, 1, name, ckpt, "bf16", True, timeout=300)[0]
    assert measured == _planned(name, ckpt, "bf16", compiled=True)
    eager = run_ranks(_block_saved, 1, name, ckpt, "bf16", False, timeout=300)[0]
    cfg = _cfg(name)
    rope = 2 * 4 * S * ModelShape.of(cfg).head_dim if ckpt == "none" and not cfg.kv_lora_rank else 0
    assert eager == _planned(name, ckpt, "bf16", compiled=False) + rope
    assert measured < eager


def test_eager_latent_attention_on_sequence_parallel_ranks():
    """Eager MLA under ``selective`` at tp 2 + SP keeps the gathered rotary key (the recomputed core's input)."""
    for measured in run_ranks(_block_saved, 2, "mla", "selective", "bf16", False, True, timeout=300):
        assert measured == _planned("mla", "selective", "bf16", compiled=False, tp=2, sp=True)


@pytest.mark.parametrize("name", ["llama_tiny", "mla"])
@pytest.mark.parametrize("ckpt", ["none", "selective"])
def test_compiled_block_on_sequence_parallel_ranks(name, ckpt):
    for measured in run_ranks(_block_saved, 2, name, ckpt, "bf16", True, True, timeout=300):
        assert measured == _planned(name, ckpt, "bf16", compiled=True, tp=2, sp=True)


def test_what_compile_saves_against_eager():
    """The differences the planner claims, piece by piece (the module table of parallel/plan/memory.py)."""
    e, sb, sbh, h = 2, B * S, B * S * D, D
    llama = ModelShape.of(preset("llama_tiny", n_layers=1, seq_len=S, d_model=D))
    for tp, sp in ((1, False), (2, False), (2, True)):
        t1 = tp if sp else 1
        norms = 2 * 4 * sbh / t1  # RMSNorm's fp32 input copy, twice
        swiglu = e * sb * llama.d_ff / tp  # silu(gate)
        o_input = e * sb * h / tp  # the attention core's output, under selective
        for ckpt, o in (("none", 0), ("selective", o_input), ("full", None)):
            eager, comp = (_planned("llama_tiny", ckpt, "bf16", c, tp, sp) for c in (False, True))
            assert eager - comp == (0 if o is None else norms + swiglu + o)
            gpt = [_planned("gpt_tiny", ckpt, "bf16", c, tp, sp) for c in (False, True)]
            assert gpt[0] - gpt[1] == (0 if o is None else o)


def _stage_saved(name: str, precision: str) -> int:
    torch._dynamo.reset()
    cfg = preset(name, n_layers=1, seq_len=S, d_model=D, vocab_size=384)
    model = build_model(cfg, seed=3, dtype=DTYPES[precision])
    compile_stage(model, "inductor")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    _saved(lambda: model.loss(model(ids), ids), params)
    return _saved(lambda: model.loss(model(ids), ids), params)


def test_compiled_loss_keeps_the_logits_not_the_log_softmax():
    """At tp = 1 the compiled loss keeps the bf16 logits and two fp32 statistics per token (eager torch
    keeps the fp32 log-softmax); the embedding, the final norm and the head are eager around it."""
    measured = run_ranks(_stage_saved, 1, "llama_tiny", "bf16", timeout=300)[0]
    shape = ModelShape.of(preset("llama_tiny", n_layers=1, seq_len=S, d_model=D, vocab_size=384))
    kw = dict(has_embedding=True, has_head=True, precision="bf16")
    assert measured == stage_activation_bytes(shape, B, 1, compiled=True, **kw)
    eager = stage_activation_bytes(shape, B, 1, **kw)
    layer = [_planned("llama_tiny", "none", "bf16", c) for c in (False, True)]
    assert eager - (layer[0] - layer[1]) - measured == (4 - 2) * B * S * shape.padded_vocab(1) - 8 * B * S


def _forward_kernel_bytes(name: str, precision: str) -> tuple[int, int]:
    """(bytes, elements of the norms' weights and statistics) of the kernels inductor generates for a
    block's forward other than the GEMMs, attention and RoPE (:meth:`GraphLowering.count_bytes`: each
    kernel's buffers read and written once)."""
    import torch._inductor.config as inductor_config
    from torch._functorch import config as functorch_config
    from torch._inductor import metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    torch._dynamo.reset()
    metrics.reset()
    cfg = preset(name, n_layers=1, seq_len=S, d_model=D)
    block = build_model(cfg, seed=3, dtype=DTYPES[precision]).blocks["0"]
    compile_block(block, "inductor")
    x = torch.randn(B, S, D, dtype=DTYPES[precision], requires_grad=True)
    torch._logging.set_logs(inductor_metrics=True)  # GraphLowering counts the bytes only while it logs them
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            block(x)  # the forward graph only: the backward compiles at its first call
    finally:
        torch._logging.set_logs()
    total = 0
    for node, words in metrics.nodes_num_elem:
        if isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
            continue
        ops = {getattr(o.target, "_opname", "") for n in node.get_nodes() for o in n.node.origins}
        if ops & {"cos", "cat", "split", "split_with_sizes"}:  # RoPE's: not priced, eager or compiled
            continue
        total += 4 * words  # count_bytes reports bytes // 4
    return total, 2 * 2 * D + 2 * 2 * B * S  # ≤ two norms' weight and bias, two fp32 statistics per token


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_compiled_elementwise_bytes_are_the_kernels(name):
    """Norms, residual adds and the MLP activation of a compiled block's forward: the kernels inductor
    generates move what :func:`elementwise_bytes` prices (plus the norms' weights and statistics, which
    it leaves out); eager prices one ``[T, d]`` read and write more (the residual written, read again)."""
    measured, extra = run_ranks(_forward_kernel_bytes, 1, name, "bf16", timeout=300)[0]
    shape = ModelShape.of(preset(name, n_layers=1, seq_len=S, d_model=D))
    planned = elementwise_bytes(shape, B * S, 1, False, 2, compiled=True)
    assert 0 <= measured - planned <= 4 * extra, (measured, planned)
    assert elementwise_bytes(shape, B * S, 1, False, 2) - planned == 2 * B * S * D


@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny"])
def test_compiled_blocks_between_zero_bubble_b_and_w_hold_their_weight_gradients(preset):
    """Under zb-h1 a chunk of compiled blocks holds, from B to W, the weight gradients its compiled nodes
    computed in B (and no recorded gradient: W runs none of them again): what the planner prices per
    waiting micro-batch (:func:`parallel.plan.deferred.compiled_deferred_bytes`), byte for byte."""
    from models.compiled import compile_block
    from models.config import preset as model_preset
    from models.transformer import build_model
    from parallel.pipeline.split_backward import SavedTensorStash, backward_input
    from parallel.plan.deferred import compiled_deferred_bytes

    torch._dynamo.reset()
    stage = build_model(model_preset(preset, n_layers=2, seq_len=16, d_model=64), seed=3)
    blocks = list(stage.blocks.values())
    for block in blocks:
        compile_block(block, "aot_eager")
    params = [p for block in blocks for p in block.parameters()]
    x = torch.randn(2, 16, 64, requires_grad=True)
    stash = SavedTensorStash()
    with stash.hooks():
        h = x
        for block in blocks:
            h = block(h)
    _, work = backward_input(h, torch.randn_like(h), x, params, stash)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for grads in work.computed.values()
            for _, t in grads}  # fmt: skip
    assert not work.recorded  # W runs no node again: nothing recorded is kept
    assert sum(held.values()) == compiled_deferred_bytes(sum(p.numel() for p in params), "fp32")
