"""The GPU MFU script: its arithmetic, its 1B model, and the CPU dry run of its code path."""

import subprocess
import sys

import pytest

from benchmarks import gpu_mfu
from parallel.testing import run_ranks


def test_peak_table_and_layouts():
    assert gpu_mfu.peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert gpu_mfu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert gpu_mfu.peak_tflops("NVIDIA H200") == 989
    assert gpu_mfu.peak_tflops("NVIDIA H100 PCIe") == 756
    assert gpu_mfu.peak_tflops("NVIDIA H100 NVL") is None  # 835 dense: no profile, ask for --peak-tflops
    assert gpu_mfu.peak_tflops("Tesla T4") is None
    assert gpu_mfu.default_layouts(1) == [(1, 1, 1)]
    assert gpu_mfu.default_layouts(8) == [(8, 1, 1), (1, 1, 8), (2, 2, 2)]
    assert gpu_mfu.default_layouts(4) == [(4, 1, 1), (1, 1, 4), (1, 4, 1)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_default_layouts_are_valid_recipes(world):
    from recipes.config import validate

    for dp, pp, tp in gpu_mfu.default_layouts(world):
        rc = gpu_mfu.recipe(dp, pp, tp, dry_run=False, micro_batch=4, global_batch=4 * 4 * world)
        assert validate(rc, world_size=world).dp == dp  # refused with a ConfigError otherwise


def test_the_gpu_model_is_about_one_billion_parameters():
    from models.transformer import build_model
    from recipes.config import model_config

    rc = gpu_mfu.recipe(1, 1, 1, dry_run=False, micro_batch=4, global_batch=16)
    n = sum(p.numel() for p in build_model(model_config(rc.model), device="meta").parameters())
    assert 0.9e9 < n < 1.3e9
    assert rc.train.precision == "bf16"


def test_without_gpu_it_says_so_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_mfu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "No CUDA GPU" in out.stdout and "tokens/s" in out.stdout


def _dry_run_layouts():
    return gpu_mfu.main(["--layout", "2,1,1", "--layout", "1,1,2", "--layout", "1,2,1"])


def test_dry_run_of_multi_gpu_layouts_trains_the_same_model():
    from parallel.plan.shape import model_flops_per_token
    from recipes.config import model_config

    results = run_ranks(_dry_run_layouts, 2, timeout=120)[0]
    losses = [r["loss"] for r in results]
    assert losses == pytest.approx([losses[0]] * 3, abs=0.02)  # bf16: same model whatever the layout
    cfg = model_config(gpu_mfu.recipe(1, 1, 1, dry_run=True, micro_batch=2, global_batch=8).model)
    for r in results:
        assert r["tflops_per_gpu"] == pytest.approx(r["tokens_per_s"] * model_flops_per_token(cfg) / 2 / 1e12)
        assert r["mfu"] is None  # no peak for a CPU
        assert 0 < r["predicted_states_GB"] < r["predicted_mem_GB"]  # the planner's figure beside the measured


def test_layouts_that_do_not_fill_the_world_are_refused(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)  # restored afterwards: later tests spawn launchers
    with pytest.raises(SystemExit):
        gpu_mfu.main(["--layout", "2,1,1"])  # one process
    assert "dp·pp·tp = 1" in capsys.readouterr().err
    assert "WORLD_SIZE" not in __import__("os").environ  # refused before touching the environment
