"""benchmarks/fp8.py (gpu_check.sh's step 8) runs on the CPU: its emulated GEMMs and its loss comparison."""

import json

from benchmarks import fp8


def test_gemm_times_both_recipes_without_kernels_here():
    out = fp8.gemm(32, reps=1)
    assert out["fp8_kernels"] is False  # a CPU: the emulation only, no kernel comparison to fail
    for scaling in ("tensorwise", "rowwise"):
        assert out[scaling]["fp8_s"] > 0 and "ok" not in out[scaling]
        assert out[scaling]["bf16_over_fp8"] == out["bf16_s"] / out[scaling]["fp8_s"]


def test_compare_passes_within_the_tolerance_and_fails_beyond(tmp_path):
    for name, loss in (("a", 2.0), ("b", 2.03), ("c", 2.1)):
        (tmp_path / name).mkdir()
        rows = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": loss}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fp8.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0  # 1.5 %
    assert fp8.main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 1  # 5 %
