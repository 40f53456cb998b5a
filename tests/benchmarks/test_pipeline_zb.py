"""The zero-bubble and background-checkpoint benchmarks run and report what they claim (tiny sizes)."""

from benchmarks.pipeline import zero_bubble


def test_zero_bubble_benchmark_reports_the_smaller_bubble_and_the_released_memory():
    r = zero_bubble(2, 4, 1, d=32, n_layers=2, seq=16)
    zb, one = r["zb-h1"], r["1f1b"]
    assert zb["bubble_simulated"] < one["bubble_simulated"]
    assert zb["peak_microbatches"] == [2, 2] and one["peak_microbatches"] == [2, 1]
    assert zb["peak_saved_bytes"][0] == one["peak_saved_bytes"][0]  # the first stage: its B is the whole backward
    assert zb["peak_saved_bytes"][1] < 2 * one["peak_saved_bytes"][1]  # B released what W does not read
    assert r["zb_vs_1f1b_wall"]["rounds"] == 1


def test_checkpoint_benchmark_times_both_saves():
    from benchmarks import checkpoint

    r = checkpoint.main(rounds=2, steps_between=1, timeout_s=240, d=32, n_layers=2, seq=16)
    assert r["sync_stall_s"] > 0 and r["background_stall_s"] > 0 and r["write_s"] > 0
