"""End to end: DeepSeek tiny (MLA, sigmoid group-limited routing, shared experts, a dense first layer,
aux-loss-free bias, sequence-wise aux loss) trains at dp=2 × ep=2 with ZeRO-1 as one process does, the
router biases after the steps bit-identical; resumed in one process from the ep=2 checkpoint (dp=4 × ep=4
× pp=2, too slow for the suite, is measured in docs/performance.md); and at tp=2 with sequence parallelism
(MLA's latents and the router on each rank's s/tp tokens), the biases bit-identical too."""

import pytest
import torch

from parallel.checkpoint.store import load_checkpoint
from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

STEPS, MOE_LAYERS, EXPERTS = 4, (1, 2, 3), 6


def _deepseek(**layout):
    return tiny_recipe(**{
        "model__preset": "deepseek_tiny", "model__moe_bias_update_rate": 0.01, "model__moe_seq_aux_loss_weight": 0.01,
        "train__max_steps": STEPS, "train__ckpt_every": 2, **layout,
    })  # fmt: skip


def _biases(run_dir, step=STEPS):
    state = {f"buffer/blocks.{i}.mlp.e_score_correction_bias": torch.zeros(EXPERTS) for i in MOE_LAYERS}
    load_checkpoint(state, run_dir / "checkpoints" / f"step_{step:08d}", verify=False)
    return torch.stack(list(state.values()))


@pytest.fixture(scope="module")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def runs(tmp_path_factory):
    one, grid, resumed, sp = (tmp_path_factory.mktemp(n) for n in ("one", "grid", "resumed", "sp"))
    run_ranks(_train, 1, _deepseek(), str(one), timeout=300)
    run_ranks(_train, 2, _deepseek(dp=2, parallel__ep=2, zero=1), str(grid), timeout=300)
    ckpt = grid / "checkpoints" / "step_00000002"
    run_ranks(_train, 1, _deepseek(train__resume=str(ckpt)), str(resumed), timeout=300)
    run_ranks(_train, 2, _deepseek(tp=2, parallel__sequence_parallel=True), str(sp), timeout=300)
    return one, grid, resumed, sp


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_grid_trains_as_one_process_and_the_router_biases_agree_bit_for_bit(runs):
    one, grid, resumed, _ = runs
    (ref_loss, ref_norm), (loss, norm) = losses(one), losses(grid)
    assert len(loss) == STEPS and loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    bias = _biases(one)
    assert bias.abs().sum() > 0  # the loads moved them (±0.01 per step)
    assert torch.equal(_biases(grid), bias)  # the load is summed over dp (and ep): the same everywhere
    # the biases saved by two ep ranks load into one process, which continues as the grid did
    assert losses(resumed)[0] == pytest.approx(ref_loss[2:], abs=1e-4)
    assert torch.equal(_biases(resumed), bias)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tensor_and_sequence_parallel_trains_as_one_process(runs):
    one, _, _, sp = runs
    (ref_loss, ref_norm), (loss, norm) = losses(one), losses(sp)
    assert len(loss) == STEPS and loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert torch.equal(_biases(sp), _biases(one))  # each TP rank routes its s/tp tokens: the load summed over tp
