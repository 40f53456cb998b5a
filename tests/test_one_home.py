"""Each shared formula, limit and name is defined once: the other users import it (issue 13, item 3).

Identity checks (``a is b``) where a module re-exports the one home; behaviour checks on
sample inputs where a module calls it.
"""

from __future__ import annotations

import pytest
import torch

import benchmarks.theory as bench
import parallel.comm as comm
import parallel.pipeline.executor as executor
import parallel.pipeline.schedules as schedules
import parallel.pipeline.simulator as simulator
import parallel.plan.inputs as plan_inputs
import parallel.plan.memory as plan_memory
import parallel.plan.traffic as plan_traffic
import parallel.precision as precision
import parallel.zero.compression as compression
import parallel.zero.config as zero_config
import parallel.zero.grads as zero_grads
import parallel.zero.layout as layout
import parallel.zero.policy as policy
import parallel.zero.theory as zero_theory
import recipes.config as config
import recipes.training.trainer as trainer
from models.config import ModelConfig
from parallel.layers.embedding import padded_vocab_size
from parallel.plan.hardware import PlanError
from parallel.topology import Topology, TopologyError, world_size_mismatch


def test_names_and_stage_numbers_have_one_home():
    assert config.CHOICES["parallel.pp_schedule"] is schedules.SCHEDULES
    assert config.CHOICES["parallel.zero"] is policy.ZERO_STAGES
    assert plan_memory.ZERO_STAGES is policy.ZERO_STAGES
    assert config.CHOICES["train.precision"] is precision.TRAIN_PRECISIONS  # PRECISIONS and fp8
    assert config.CHOICES["train.fp8_recipe"] is precision.FP8_RECIPES
    assert config.CHOICES["comm.dtype"] == (None, *precision.PRECISIONS)
    assert config.CHOICES["comm.compression"] is compression.COMPRESSIONS
    from recipes.training.runlog import LR_SCHEDULES, lr_at

    assert config.CHOICES["optim.schedule"] is LR_SCHEDULES
    kw = dict(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10)
    assert len({lr_at(3, schedule=s, **kw) for s in LR_SCHEDULES}) == len(LR_SCHEDULES)  # each name does something


def test_checkpointing_modes_have_one_home():
    import models.config
    import parallel.memory

    assert models.config.CHECKPOINTING is parallel.memory.CHECKPOINTING is plan_inputs.CHECKPOINTING


def test_precision_tables_have_one_home():
    assert zero_theory.DTYPE_BYTES is precision.DTYPE_BYTES
    assert plan_memory.PRECISION_BYTES is precision.DTYPE_BYTES
    assert zero_config.DTYPES is precision.TORCH_DTYPES
    assert trainer.COMPUTE_DTYPES is precision.TORCH_DTYPES
    for name, dtype in precision.TORCH_DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == precision.DTYPE_BYTES[name]


@pytest.mark.parametrize("stage", policy.ZERO_STAGES)
def test_model_state_bytes_have_one_home(stage):
    psi, dp = 1000, 4  # psi a multiple of dp: the planner's padding is then a no-op
    ours = zero_theory.model_state_bytes(psi, stage, dp, param_bytes=2, state_tensors=2)
    assert plan_memory.model_state_bytes(psi, stage, dp, "bf16", "adamw") == {k: int(v) for k, v in ours.items()}
    pol = policy.policy(stage)
    assert ours["optimizer"] == 12 * psi / (dp if pol.shards_optimizer else 1)


def test_padding_and_bucket_packing_have_one_home():
    assert plan_memory.padded is layout.padded
    sizes = [5, 7, 30, 2, 2, 9]
    buckets = layout.plan_buckets(
        [(f"p{i}", (n,), True, 0, "") for i, n in enumerate(sizes)], dp=4, bucket_bytes=40, element_size=4
    )
    packed = [[int(s.name[1:]) for s in b.slots] for b in buckets]
    assert packed == layout.pack(sizes, 4, 40) == [[0], [1], [2], [3, 4], [5]]
    assert list(plan_memory._bucket_sizes(tuple(sizes), 40, 4)) == [b.numel for b in buckets]


def test_ring_factors_and_topk_wire_count_have_one_home():
    assert plan_traffic.SENT_FRACTION is comm.SENT_FRACTION
    assert plan_traffic.topk_kept is compression.topk_count
    assert plan_traffic.INDEX_BYTES is compression.INDEX_BYTES
    # the benchmark's stage-2/3 rows and the theory agree where they should (m = 1)
    for stage in (0, 1, 2):
        assert bench.dp_bytes(1000, stage, 4, 1) == pytest.approx(zero_theory.step_sent_bytes(1000, stage, 4))
    assert zero_theory.step_sent_bytes(1000, 0, 4) == comm.SENT_FRACTION["all_reduce"](4) * 1000 * 4


def test_padded_vocab_has_one_home():
    cfg = ModelConfig(vocab_size=1000, vocab_multiple=64)
    for tp in (1, 2, 3, 8):
        assert cfg.padded_vocab(tp) == padded_vocab_size(1000, tp, 64)


def test_virtual_stage_peers_have_one_home():
    assert executor.peer_of is schedules.peer_of is simulator.peer_of
    assert executor.virtual_stage is schedules.virtual_stage is simulator.virtual_stage
    pp, vpp = 3, 2
    assert [schedules.peer_of(v, pp, vpp, to_next=True) for v in range(6)] == [1, 2, 0, 1, 2, None]
    assert [schedules.peer_of(v, pp, vpp, to_next=False) for v in range(6)] == [None, 0, 1, 2, 0, 1]


def test_world_size_message_has_one_home():
    msg = world_size_mismatch(16, 2, 2, 2)
    with pytest.raises(TopologyError) as e:
        Topology(2, 2, 2, world_size=16)
    assert str(e.value) == msg
    from parallel.plan.inputs import Layout, Training, check
    from parallel.plan.shape import ModelShape

    with pytest.raises(PlanError) as e:
        check(ModelShape.of(ModelConfig()), Layout(dp=2, pp=2, tp=2), Training(16, 2), world_size=16)
    assert str(e.value) == msg
    assert plan_inputs.world_size_mismatch is world_size_mismatch


def test_schedule_rule_is_shared_by_library_planner_and_config():
    """``interleaved`` with vpp=1 is refused by the library exactly as by the config."""
    problem = schedules.schedule_problem("interleaved", 2, 1)
    with pytest.raises(schedules.ScheduleError) as e:
        schedules.build_schedule("interleaved", 2, 4, vpp=1)
    assert str(e.value) == problem
    rc = config.RecipeConfig()
    rc.parallel.pp, rc.parallel.pp_schedule, rc.parallel.vpp = 2, "interleaved", 1
    with pytest.raises(config.ConfigError) as e:
        config.validate(rc, world_size=None)
    assert schedules.schedule_problem("interleaved", 2, 1, prefix="parallel.") in str(e.value)


def test_cross_entropy_all_reduce_bytes_have_one_home():
    from benchmarks import theory as bench
    from parallel.layers import cross_entropy
    from parallel.plan import traffic

    assert traffic.CE_MAX_BYTES_PER_TOKEN is cross_entropy.CE_MAX_BYTES_PER_TOKEN
    assert traffic.CE_SUMS_BYTES_PER_TOKEN is cross_entropy.CE_SUMS_BYTES_PER_TOKEN
    assert bench.CE_ALL_REDUCE_BYTES_PER_TOKEN is cross_entropy.CE_ALL_REDUCE_BYTES_PER_TOKEN


def test_zero3_accumulation_formulas_have_one_home():
    import parallel.plan.buffers as plan_buffers
    import recipes.validation as validation

    assert plan_traffic.grad_reductions_per_step is zero_theory.grad_reductions_per_step
    assert bench.grad_reductions_per_step is zero_theory.grad_reductions_per_step
    assert plan_buffers.accumulation_grad_bytes is zero_theory.accumulation_grad_bytes
    assert validation.ZERO_ACCUMULATE is zero_theory.ZERO_ACCUMULATE is zero_config.ZERO_ACCUMULATE
    assert validation.accumulate_applies is zero_theory.accumulate_applies is zero_config.accumulate_applies


def test_overlap_facts_have_one_home():
    """What overlaps (parallel/overlap.py): the engine's constants and the planner's rows are its objects."""
    import parallel.overlap as overlap
    import parallel.plan.buffers as plan_buffers
    import parallel.plan.cp as plan_cp
    import parallel.plan.exposure as plan_exposure
    import parallel.plan.offload as plan_offload
    import parallel.plan.pipeline as plan_pipeline
    import parallel.plan.stage as plan_stage
    import parallel.zero.units as units

    assert zero_theory.REDUCTIONS_IN_FLIGHT is overlap.REDUCTIONS_IN_FLIGHT
    import parallel.zero.packing as packing  # the planner's in-flight count is packing.reduction_buffer_bytes

    assert zero_grads.REDUCTIONS_IN_FLIGHT is packing.REDUCTIONS_IN_FLIGHT is overlap.REDUCTIONS_IN_FLIGHT
    assert units.ZERO3_PREFETCH_UNITS is plan_buffers.ZERO3_PREFETCH_UNITS is overlap.ZERO3_PREFETCH_UNITS
    rows = {
        "DP_REDUCTION": plan_exposure,
        "ZERO3_GATHER": plan_exposure,
        "PARAM_GATHER_AFTER_STEP": plan_exposure,
        "PIPELINE_P2P": plan_pipeline,
        "TP_COLLECTIVES": plan_stage,
        "TP_SP_BACKWARD": plan_stage,
    }
    for name, planner in rows.items():
        assert getattr(planner, name) is getattr(overlap, name) and getattr(overlap, name) in overlap.TABLE
    assert plan_cp.RING_ATTENTION is overlap.RING_ATTENTION
    assert plan_offload.OFFLOAD_PARAM_PAGING is overlap.OFFLOAD_PARAM_PAGING
    assert plan_offload.OFFLOAD_STEP is overlap.OFFLOAD_STEP


# --- the layout's rules: one home (parallel.dims), the same words from the library, the planner and the config


def _config_error(**changes):
    """The recipe config's refusal of ``changes`` (``section__key=value``)."""
    rc = config.RecipeConfig()
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(rc, section), key, value)
    with pytest.raises(config.ConfigError) as e:
        config.validate(rc, world_size=None)
    return str(e.value)


def test_topk_needs_stage_0_has_one_home():
    import parallel.dims as dims
    from parallel.plan.inputs import resolve
    from parallel.plan.shape import ModelShape
    from parallel.zero.layout import ZeroConfigError

    msg = dims.compression_problem("topk", 2)
    with pytest.raises(ZeroConfigError) as e:
        zero_config.ZeroConfig(stage=2, compression="topk")
    assert str(e.value) == msg
    with pytest.raises(PlanError) as e:
        resolve(ModelShape.of(ModelConfig()), dp=2, zero=2, compression="topk")
    assert str(e.value) == msg
    with pytest.raises(dims.LayoutError) as e:
        dims.ParallelDims(zero=2, compression="topk")
    assert str(e.value) == msg
    assert _config_error(comm__compression="topk", parallel__zero=2).endswith(msg)
    assert dims.compression_problem("topk", 0) is None
    # the ratio's rule too: the library's counter, the planner and the config
    with pytest.raises(ZeroConfigError, match=r"^topk_ratio must be in \(0, 1\], got 0$"):
        compression.topk_count(10, 0)
    assert _config_error(comm__topk_ratio=0.0) == "comm." + dims.topk_ratio_problem(0.0)


def test_sequence_parallel_rules_have_one_home():
    import parallel.dims as dims
    from parallel.plan.inputs import Layout, Training, check, resolve
    from parallel.plan.shape import ModelShape

    shape = ModelShape.of(ModelConfig(seq_len=30, n_heads=4, d_model=64))
    with pytest.raises(PlanError) as e:
        check(shape, Layout(tp=4, sequence_parallel=True), Training(16, 2))
    assert str(e.value) == dims.sequence_split_problem(30, 4)
    with pytest.raises(PlanError) as e:
        resolve(shape, sequence_parallel=True)
    assert str(e.value) == dims.sequence_parallel_problem(1)
    assert _config_error(parallel__sequence_parallel=True).endswith(dims.sequence_parallel_problem(1))
    # the model's own guard on the tokens it is given
    from models.config import ModelConfigError
    from models.transformer import build_model

    model = build_model(ModelConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64, seq_len=8), seed=0)
    model.sequence_parallel, model.tp_size = True, 4  # what a tp=4 SP rank would check
    with pytest.raises(ModelConfigError) as e:
        model._embed(torch.zeros(1, 6, dtype=torch.long))
    assert str(e.value) == dims.sequence_split_problem(6, 4)


def test_cp_rules_and_local_sequence_have_one_home():
    import importlib

    import parallel.dims as dims
    import parallel.plan.cp as plan_cp
    from parallel.layers import LayerConfigError, check_cp_seq_len, check_ulysses_heads

    ring_attention = importlib.import_module(
        "parallel.layers.ring_attention"
    )  # the package exports a function of that name
    from parallel.plan.shape import ModelShape

    assert ring_attention.CP_IMPLS is dims.CP_IMPLS is config.CHOICES["parallel.cp_impl"]
    with pytest.raises(LayerConfigError) as e:
        check_cp_seq_len(30, 2)
    assert str(e.value) == dims.cp_seq_len_problem(30, 2)
    assert _config_error(parallel__cp=2, model__seq_len=30) == f"parallel.cp=2: {dims.cp_seq_len_problem(30, 2)}"
    with pytest.raises(LayerConfigError) as e:
        check_ulysses_heads(2, 2, 4, 1)
    assert str(e.value) == dims.ulysses_heads_problem(2, 2, 4, 1)
    from parallel.plan.inputs import resolve

    with pytest.raises(PlanError) as e:
        resolve(ModelShape.of(ModelConfig(seq_len=30)), cp=2)
    assert str(e.value) == dims.cp_seq_len_problem(30, 2)
    shape = ModelShape.of(ModelConfig(seq_len=64))
    assert (
        plan_cp.local_shape(shape, 4).seq_len
        == dims.local_seq_len(64, 4)
        == dims.ParallelDims(cp=4, seq_len=64).local_seq_len
    )
    rc = config.RecipeConfig()
    rc.parallel.cp, rc.model.seq_len = 2, 64
    layout = config.validate(rc, world_size=None)
    assert layout.dims.local_seq_len == 32 and layout.dims.dense_grad_group == "dpcp"


def test_tp_head_rule_has_one_home():
    import parallel.dims as dims
    from models.config import ModelConfigError
    from parallel.plan.inputs import resolve

    msg = dims.tp_split_problem(4, 4, 512, 3)
    with pytest.raises(ModelConfigError) as e:
        ModelConfig(n_heads=4, d_model=128).validate(tp=3)
    assert str(e.value) == msg
    with pytest.raises(PlanError) as e:
        resolve(ModelConfig(n_heads=4, d_model=128), tp=3)
    assert str(e.value) == msg
    with pytest.raises(dims.LayoutError) as e:
        dims.ParallelDims(tp=3, n_heads=4, n_kv_heads=4, d_ff=512)
    assert str(e.value) == msg


def test_ep_stage_and_interleaved_rules_have_one_home():
    import parallel.dims as dims
    import parallel.topology as topology
    from parallel.plan.inputs import Layout, Training, check
    from parallel.plan.shape import ModelShape

    assert topology.ep_mismatch is dims.ep_mismatch and topology.world_size_mismatch is dims.world_size_mismatch
    with pytest.raises(TopologyError) as e:
        Topology(6, ep=4)
    assert str(e.value) == dims.ep_mismatch(6, 4)
    shape = ModelShape.of(ModelConfig())  # 4 layers
    with pytest.raises(PlanError) as e:
        check(shape, Layout(pp=8), Training(16, 2))
    assert str(e.value) == dims.stages_problem(8, 1, 4)
    assert _config_error(parallel__pp=8).endswith(dims.stages_problem(8, 1, 4))
    with pytest.raises(PlanError) as e:
        check(shape, Layout(pp=2, vpp=2, schedule="interleaved"), Training(6, 2))
    assert str(e.value) == dims.interleaved_problem("interleaved", 2, 6, 2, 1)
    assert _config_error(
        parallel__pp=2,
        parallel__vpp=2,
        parallel__pp_schedule="interleaved",
        train__global_batch=6,
        train__micro_batch=2,
    ).endswith(dims.interleaved_problem("interleaved", 2, 6, 2, 1))


def test_offload_rule_has_one_home():
    import parallel.dims as dims
    import parallel.zero.offload as offload
    from parallel.plan.inputs import resolve
    from parallel.plan.shape import ModelShape
    from parallel.zero.layout import ZeroConfigError

    assert offload.OFFLOAD_MODES is dims.OFFLOAD_MODES is config.CHOICES["parallel.offload"]
    assert offload.MIN_STAGE is dims.OFFLOAD_MIN_STAGE
    with pytest.raises(ZeroConfigError) as e:
        offload.check_offload("optimizer+params", 2)
    assert str(e.value) == dims.offload_problem("optimizer+params", 2)
    with pytest.raises(PlanError) as e:
        resolve(ModelShape.of(ModelConfig()), dp=2, zero=2, offload="optimizer+params")
    assert str(e.value) == dims.offload_problem("optimizer+params", 2)
    with pytest.raises(dims.LayoutError) as e:
        dims.ParallelDims(zero=2, offload="optimizer+params")
    assert str(e.value) == dims.offload_problem("optimizer+params", 2)
    msg = _config_error(parallel__zero=0, parallel__offload="optimizer")
    assert msg == dims.offload_problem("optimizer", 0, prefix="parallel.")


def test_unsharded_accumulation_rule_has_one_home():
    import parallel.dims as dims
    from parallel.zero.layout import ZeroConfigError

    with pytest.raises(ZeroConfigError) as e:
        zero_config.ZeroConfig(stage=1, accumulate="unsharded")
    assert str(e.value) == dims.accumulate_problem("unsharded", 1)
    with pytest.raises(dims.LayoutError) as e:
        dims.ParallelDims(zero=1, accumulate="unsharded")
    assert str(e.value) == dims.accumulate_problem("unsharded", 1)
    msg = _config_error(parallel__zero=1, parallel__zero_accumulate="unsharded")
    assert msg == dims.accumulate_problem("unsharded", 1, key="parallel.zero_accumulate", stage_key="parallel.zero")
    assert [s for s in policy.ZERO_STAGES if dims.accumulate_problem("unsharded", s) is None] == [2, 3]


def test_the_planner_prices_the_resolved_layout():
    """The planner's layout is parallel.dims' resolved layout: its refusals are that layout's words, and the
    local sequence, the pipeline message, the ZeRO groups and the search's offload stages are read from it."""
    import math

    import parallel.dims as dims
    import parallel.plan as plan
    import parallel.plan.search as plan_search
    from parallel.plan.inputs import Setup
    from tests.parallel.plan.test_planner import SHAPE, count

    assert plan.Layout is dims.ParallelDims
    assert plan_search.OFFLOAD_MIN_STAGE is dims.OFFLOAD_MIN_STAGE and plan_search.OFFLOAD_MODES is dims.OFFLOAD_MODES
    with pytest.raises(dims.LayoutError) as layout_error:
        dims.ParallelDims(dp=2, ep=2)
    with pytest.raises(PlanError) as e:
        plan.resolve(SHAPE, dp=2, ep=2)
    assert str(e.value) == str(layout_error.value)
    layout = plan.resolve(SHAPE, dp=2, pp=2, tp=2, cp=2, ep=1, sequence_parallel=True)
    ctx = Setup(SHAPE, layout, plan.Training(16, 2), plan.hardware_profile("a100_80gb"), count)
    assert ctx.local.seq_len == layout.local_seq_len == 8
    assert ctx.act_msg == 2 * math.prod(layout.activation_shape(2, SHAPE.d_model))  # bf16, SP's slice
    assert ctx.zdp == layout.group_size(layout.dense_grad_group) == 4 and ctx.edp == ctx.zdp
    p = plan.plan_layout(SHAPE, layout, plan.Training(16, 2), plan.hardware_profile("a100_80gb"), count)
    assert p.ranks[0].traffic["dp"]["group_size"] == ctx.zdp and p.ranks[0].traffic["cp"]["group_size"] == layout.cp
