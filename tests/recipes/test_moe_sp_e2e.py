"""End to end, MoE under tensor + sequence parallelism (issue 33): each TP rank routes its s/tp tokens.

Held to one process: Mixtral tiny at tp=2 + SP; Qwen3-MoE tiny (qwen3_tiny with experts) at dp=2 × tp=2 + SP
× ep=2; a DeepSeek-style router (sigmoid scores, aux-loss-free bias, sequence-wise loss, a shared expert) at
tp=2 + SP, the bias after the steps bit-identical. The suite runs 4 steps; 10 steps were measured once
(docs/performance.md)."""

import pytest
import torch

from parallel.checkpoint.store import load_checkpoint
from parallel.testing import run_ranks

from .test_train_e2e import _train, losses, tiny_recipe

STEPS = 4
SP = dict(tp=2, parallel__sequence_parallel=True)
MODELS = {
    "mixtral": {"model__preset": "mixtral_tiny", "model__n_layers": 2},
    "qwen3_moe": {
        "model__preset": "qwen3_tiny", "model__n_layers": 2, "model__d_model": 64, "model__moe_experts": 6,
        "model__moe_top_k": 2, "model__moe_d_ff": 24, "model__moe_aux_loss_weight": 0.001,
    },
    "sigmoid_bias": {
        "model__preset": "mixtral_tiny", "model__n_layers": 2, "model__moe_score": "sigmoid",
        "model__moe_bias_update_rate": 0.01, "model__moe_seq_aux_loss_weight": 0.01, "model__moe_shared_experts": 1,
        "train__ckpt_every": STEPS,
    },
}  # fmt: skip
LAYOUTS = {"mixtral": SP, "qwen3_moe": dict(dp=2, parallel__ep=2, **SP), "sigmoid_bias": SP}


def _biases(run_dir):
    state = {f"buffer/blocks.{i}.mlp.e_score_correction_bias": torch.zeros(4) for i in range(2)}
    load_checkpoint(state, run_dir / "checkpoints" / f"step_{STEPS:08d}", verify=False)
    return torch.stack(list(state.values()))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("model", list(MODELS))
def test_moe_with_sequence_parallelism_trains_as_one_process(tmp_path, model):
    one, grid = tmp_path / "one", tmp_path / "grid"
    layout = LAYOUTS[model]
    run_ranks(_train, 1, tiny_recipe(train__max_steps=STEPS, **MODELS[model]), str(one), timeout=300)
    rc = tiny_recipe(train__max_steps=STEPS, **MODELS[model], **layout)
    run_ranks(_train, layout.get("dp", 1) * layout["tp"], rc, str(grid), timeout=300)
    (ref_loss, ref_norm), (loss, norm) = losses(one), losses(grid)
    assert len(loss) == STEPS and loss == pytest.approx(ref_loss, abs=1e-4)
    assert norm == pytest.approx(ref_norm, rel=1e-4)
    if model == "sigmoid_bias":
        bias = _biases(one)
        assert bias.abs().sum() > 0 and torch.equal(_biases(grid), bias)  # load summed over tp under SP
