"""``mode=plan`` / ``mode=recommend`` through the recipe config, the brief's scenarios, the docs page."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.config import ConfigError
from recipes.tools import docblocks
from recipes.tools.plan import run_plan
from recipes.tools.plan_scenarios import MARKS, render, scenario_7b, scenario_config

ROOT = Path(__file__).resolve().parents[2]


def test_run_plan_prints_a_table_and_writes_plan_json(tmp_path, capsys):
    rc = scenario_config(
        [
            "model.preset=gpt_tiny",
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.dp=2",
            "parallel.zero=1",
            "plan.hardware=cpu",
            "train.global_batch=16",
        ]
    )
    summary = run_plan(rc, str(tmp_path))
    out = capsys.readouterr().out
    assert "plan for gpt_tiny" in out and "step" in out and "tokens/s" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["ranks"]) == 2 and plan["layout"]["tp"] == 2 and plan["grad_accum"] == 2
    assert summary["fits"] is True and summary["layout"] == "dp2·pp2·tp2 zero1"
    assert summary["peak_gb"] == round(plan["peak_memory_bytes"] / 1e9, 2)
    # the tied embedding, split over two stages, is all-reduced between them
    assert plan["ranks"][0]["traffic"]["embedding"]["bytes"] > 0


def test_recommend_through_the_config(tmp_path, capsys):
    rc = scenario_config(
        ["mode=recommend", "model.preset=gpt_tiny", "plan.world_size=4", "plan.top=3", "train.global_batch=16"]
    )
    summary = run_plan(rc, str(tmp_path))
    plans = json.loads((tmp_path / "plan.json").read_text())
    assert 1 <= len(plans) <= 3 and all(p["fits"] for p in plans)
    assert summary["tokens_per_s"] == round(plans[0]["step"]["tokens_per_s"], 1)
    assert "best layouts" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3"], r"n_heads 4 is not divisible by tp 3; choose tp among the divisors of 4: \[1, 2, 4\]"),
        (["parallel.pp=8"], "pp 8 × vpp 1 = 8 stages but the model has 4 layers"),
        (["parallel.dp=3", "train.global_batch=16"], "global_batch 16 is not a multiple"),
        (["plan.hardware=tpu_v9"], "unknown hardware profile 'tpu_v9'"),
        (["parallel.dp=2", "plan.world_size=16"], "world size 16 ≠ dp 2 × pp 1 × tp 1 = 2"),
        (["plan.world_size=0"], r"plan.world_size=0 must be a positive integer"),
        (["mode=recommend", "plan.world_size=0"], r"plan.world_size=0 must be a positive integer"),
        (["plan.efficiency=nan"], r"efficiency=nan must be a finite number"),
        (["plan.inter_node_gbps=-1"], r"inter_node_gbps=-1.0 must be > 0"),
    ],
)
def test_bad_input_is_refused_with_the_numbers(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_plan(scenario_config(["model.preset=gpt_tiny"] + overrides), str(tmp_path))


def test_7b_on_8_a100_fits_only_with_zero2_and_recomputation():
    _, _, plans = scenario_7b()
    no_zero, zero2 = plans["no_zero"], plans["zero2"]
    assert not no_zero.fits and zero2.fits
    assert no_zero.ranks[0].memory["model_states"] == 18 * 6_738_415_616  # 2 + 4 (fp32 gradients) + 12
    assert any("ZeRO" in a for a in no_zero.advice)


def test_docs_page_shows_the_generated_figures():
    page = (ROOT / "docs" / "planner.md").read_text()
    assert docblocks.is_current(page, MARKS, render()), (
        "docs/planner.md is stale: run python -m recipes.tools.plan_scenarios"
    )


def test_command_line_multirun_gathers_one_table(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "recipes.gpt_tiny",
        "-m",
        "mode=plan",
        "parallel.tp=1,2",
        f"hydra.sweep.dir={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "sweep summary" in res.stdout
    assert "parallel.tp=1" in res.stdout and "parallel.tp=2" in res.stdout and "tokens_per_s=" in res.stdout
    assert len(list(tmp_path.glob("*/plan.json"))) == 2
    # ONE table on the screen: each job's full table goes to its plan.txt
    assert res.stdout.count("sweep summary") == 1 and "plan for" not in res.stdout, res.stdout[:2000]
    assert all("plan for" in (tmp_path / job / "plan.txt").read_text() for job in ("0", "1"))


def test_plain_table_without_rich(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails: plain text
    run_plan(scenario_config(["model.preset=gpt_tiny", "parallel.pp=2", "plan.hardware=cpu"]), str(tmp_path))
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "params/rank" in line)
    assert "stage" in header and "┃" not in out and "total GB" in header


def test_user_hardware_profile_from_config(tmp_path):
    lab = {
        "peak_tflops_16": 100.0,
        "peak_tflops_32": 10.0,
        "memory_bytes": 1e6,
        "intra_node_gbps": 32.0,
        "inter_node_gbps": 3.0,
        "gpus_per_node": 2,
    }
    rc = scenario_config(
        ["model.preset=gpt_tiny", "plan.hardware=lab", "parallel.tp=4"]
        + [f"plan.profiles.lab.{k}={v}" for k, v in lab.items()]
    )
    summary = run_plan(rc, str(tmp_path))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["hardware"]["name"] == "lab" and summary["fits"] is False  # 1 MB of memory
    assert plan["ranks"][0]["traffic"]["tp"]["crosses_node"]  # tp=4 over 2-device nodes


def test_one_device_plan_is_strict_json(tmp_path):
    summary = run_plan(scenario_config(["model.preset=gpt_tiny", "plan.hardware=cpu"]), str(tmp_path))
    plan = json.loads((tmp_path / "plan.json").read_text())  # written with allow_nan=False
    assert plan["step"]["comm_s"] == 0 and plan["step"]["compute_comm_ratio"] is None
    assert summary["fits"] is True
