"""The suite measures what it claims: bytes as theory says, bubbles from real timelines,
both contenders on the same data, and it writes its table, JSON and chart."""

import json

import pytest

from benchmarks import run
from parallel.testing import run_ranks

TWO_RANK_PAIRS = run.SECTIONS["dp"][1] + run.SECTIONS["tp"][1] + run.SECTIONS["pp"][1]


@pytest.fixture(scope="module")
def two_rank_rows():
    per_rank = run_ranks(run._section_rank, 2, TWO_RANK_PAIRS, True, 1, 0, timeout=240)
    return {
        name: run.summarize(name, parallel, kind, 2, [r[i] for r in per_rank])
        for i, (name, parallel, kind) in enumerate(TWO_RANK_PAIRS)
    }


def test_our_bytes_match_theory_in_every_two_rank_row(two_rank_rows):
    for name, row in two_rank_rows.items():
        assert row["theory_sent_MB"] > 0, name
        assert row["ours_sent_MB"] == pytest.approx(row["theory_sent_MB"], rel=0.02), name


def test_pytorch_traffic_is_counted_where_visible(two_rank_rows):
    # DDP all-reduces the same gradients ZeRO-0 does: the same ring volume
    assert two_rank_rows["dp ZeRO-0"]["theirs_sent_MB"] == pytest.approx(
        two_rank_rows["dp ZeRO-0"]["theory_sent_MB"], rel=0.02
    )
    # FSDP2 without resharding (after forward, nor after a non-final backward): one all-gather and one
    # reduce-scatter per step (gradient sync only on the last micro-batch); ours stage 2 accumulating
    # unsharded (the row's mode) the same
    m, rs = 4, two_rank_rows["dp ZeRO-0"]["theory_sent_MB"] / 2  # all-reduce 2ρ·Ψ·4 B; its half ρ·Ψ·4 B
    assert two_rank_rows["dp ZeRO-2"]["theirs_sent_MB"] == pytest.approx(2 * rs, rel=0.02)
    assert two_rank_rows["dp ZeRO-2"]["ours_sent_MB"] == pytest.approx(2 * rs, rel=0.02)
    # FSDP2 resharding and reducing every micro-batch: all-gathers in forward and backward and a
    # reduce-scatter, each micro-batch; with gradient sync off until the last: one reduce-scatter
    assert two_rank_rows["dp ZeRO-3"]["theirs_sent_MB"] == pytest.approx(3 * m * rs, rel=0.02)
    assert two_rank_rows["dp ZeRO-3 unsharded acc."]["theirs_sent_MB"] == pytest.approx((2 * m + 1) * rs, rel=0.02)
    # ours accumulating unsharded at stage 3: FSDP2's gradient traffic, one reduce-scatter per step
    ours3, fsdp3 = two_rank_rows["dp ZeRO-3 unsharded acc."], two_rank_rows["dp ZeRO-3"]
    assert ours3["ours_sent_MB"] == pytest.approx(fsdp3["ours_sent_MB"] - (m - 1) * rs, rel=0.02)
    assert two_rank_rows["tp=2"]["theirs_sent_MB"] is None  # DTensor's functional collectives: not seen


def test_where_the_algorithms_match_ours_sends_and_holds_no_more(two_rank_rows):
    for name in ("dp ZeRO-0", "dp ZeRO-1 vs equal bytes", "dp ZeRO-3", "dp ZeRO-3 unsharded acc."):
        row = two_rank_rows[name]
        assert row["ours_sent_MB"] <= row["theirs_sent_MB"] * (1 + 1e-9), name
    for name in ("dp ZeRO-0", "dp ZeRO-3", "dp ZeRO-3 unsharded acc."):  # FSDP2 shards parameters: not ZeRO-1/2
        row = two_rank_rows[name]
        assert row["ours_state_MB"] <= row["theirs_state_MB"] * (1 + 1e-9), name
    # ZeroRedundancyOptimizer broadcasts every parameter after the all-reduce: 1.5x, as its label says
    zro = two_rank_rows["dp ZeRO-1"]
    assert zro["theirs_sent_MB"] == pytest.approx(1.5 * zro["ours_sent_MB"], rel=0.02)


def test_the_gloo_tuned_column_is_ours_with_the_same_bytes_only_where_zero_shards(two_rank_rows):
    for name, row in two_rank_rows.items():
        if name.startswith("dp ZeRO-") and not name.startswith("dp ZeRO-0"):
            assert row["tuned_sent_MB"] == pytest.approx(row["ours_sent_MB"], rel=1e-9), name
            assert row["tuned_cpu_ratio"] > 0 and row["tuned_ratio"] > 0, name
        else:
            assert row["tuned_sent_MB"] is None and row["tuned_cpu_ratio"] is None, name


def test_bubble_is_measured_only_for_pipelines(two_rank_rows):
    pp = two_rank_rows["pp=2 1F1B"]
    assert pp["bubble_theory"] == pytest.approx(1 / 9)  # m = 16 / 2 = 8 micro-batches on 2 stages
    assert 0 < pp["bubble"] < 1
    assert two_rank_rows["pp=2 interleaved v=2"]["bubble_theory"] == pytest.approx(1 / 17)
    assert two_rank_rows["dp ZeRO-1"]["bubble"] is None


def test_model_state_per_rank_follows_the_zero_stage(two_rank_rows):
    state = [two_rank_rows[f"dp ZeRO-{k}"]["ours_state_MB"] for k in range(4)]
    # fp32 AdamW, bytes per parameter on 2 ranks: 4 + 4 + 8 = 16; optimizer state halved: 12;
    # and gradients: 10; and parameters: 8
    assert [s / state[0] for s in state] == pytest.approx([1, 12 / 16, 10 / 16, 8 / 16], rel=0.02)


def test_main_writes_table_json_history_and_chart(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"old": 1}, "rows": []}))  # the one-run form
    args = ["--only", "single", "--rows", "single process", "--quick", "--steps", "2", "--warmup", "0"]
    rows = run.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["meta"].get("old") for r in saved["runs"]] == [1, None]  # appended to the history
    assert saved["runs"][-1]["rows"] == json.loads(json.dumps(rows))
    assert saved["runs"][-1]["meta"]["sizes"] == ["small"] and saved["runs"][-1]["meta"]["date"]
    assert saved["runs"][-1]["meta"]["rows"] == ["single process"]
    (row,) = rows
    assert row["rounds"] == 2 and row["ours_sent_MB"] == 0 and row["theory_sent_MB"] == 0
    assert row["size"] == "small" and row["cpu_ratio"] > 0 and row["cpu_ours_ms"] > 0
    assert row["ours_state_MB"] == pytest.approx(row["theirs_state_MB"], rel=1e-6)  # same params, grads, AdamW
    assert "| single process | small | 1 | plain PyTorch |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "ratios.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_section_or_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        run.main(["--only", "dp,bogus"])
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--only", "dp", "--sizes", "small,huge"])
    assert "huge" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a row of another section (or none) is refused before anything runs
        run.main(["--only", "dp", "--rows", "dp ZeRO-0,pp=2 1F1B"])
    assert "pp=2 1F1B" in capsys.readouterr().err


def test_timing_loops_synchronise_through_parallel_comm():
    # NCCL rules: a host-synchronising barrier through parallel.comm (a device tensor, a host read),
    # never torch's own dist.barrier, in the suite's timing loops
    import inspect

    from benchmarks import common, pipeline, zero

    for module in (run, common, pipeline, zero):
        src = inspect.getsource(module)
        assert "dist.barrier(" not in src, module.__name__
    assert "comm.barrier()" in inspect.getsource(common.time_alternating)
