"""The hang watchdog, the communication fault drills and ``diagnose`` on what they leave, stragglers,
and the memory forensics: each drill at the smallest layout that shows it (2 gloo ranks, a 2-layer
d_model 32 GPT, 2-3 steps). The 8-rank dp2·pp2·tp2 table: ``python -m benchmarks.drills``."""

import contextlib
import json

import pytest
import torch

from parallel import comm
from parallel.comm import flight
from parallel.testing import RankFailure, run_ranks
from recipes.tools.diagnose import diagnose
from recipes.training import forensics
from recipes.training.guards import stragglers
from recipes.training.watchdog import HANG_MIN_S, Watchdog, pending_call

from .test_train_e2e import tiny_recipe

HANG_S = 3.0  # the drills' watchdog: far above a step here (≈0.1 s), far below the harness's timeout


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_watchdog_arms_after_a_step_at_five_medians_and_at_least_a_minute():
    clock = Clock()
    auto = Watchdog(None, "/nonexistent", 3, clock=clock, start=False, recorder=flight.FlightRecorder())
    auto.begin(1)
    clock.now = 1000.0
    assert auto.limit() is None and auto.expired() is None  # the first step warms up: not armed
    auto.end()
    for step, seconds in ((2, 20.0), (3, 30.0), (4, 40.0)):
        auto.begin(step)
        clock.now += seconds
        auto.end()
    assert auto.limit() == 5 * 35.0  # the median of 1000, 20, 30, 40
    auto.begin(5)
    clock.now += 170.0
    assert auto.expired() is None
    clock.now += 10.0
    assert auto.expired() == 180.0
    auto.end()
    clock.now += 1e6
    assert auto.expired() is None  # between steps (a save) nothing is timed
    fast = Watchdog(None, "/x", 0, clock=clock, start=False)
    fast.times = [0.1, 0.2]
    assert fast.limit() == HANG_MIN_S
    assert Watchdog(0, "/x", 0, clock=clock, start=False).limit() is None  # off
    fixed = Watchdog(7.5, "/x", 0, clock=clock, start=False)
    assert fixed.limit() is None  # the first step is not timed either
    fixed.times = [100.0]
    assert fixed.limit() == 7.5


def test_the_watchdog_line_names_the_rank_the_step_and_the_pending_call_with_its_phase():
    rec = flight.FlightRecorder()
    rec.phase = "step 5"
    rec.action = [type("SendActivation", (), {"mb": 1, "chunk": 0})()]
    rec.record("pp", None, "send", 64, "float32", 4)
    dog = Watchdog(30, "/x", 2, clock=Clock(), start=False, recorder=rec)
    dog.times = [1.0]  # armed: a step is done
    dog.begin(5)
    assert dog.message(31.0) == (
        "watchdog: rank 2 made no progress for 31 s in step 5 (parallel.hang_s=30); "
        "inside send #0 with rank 4 on pp (step 5 SendActivation mb1)"
    )
    rec.done()
    rec.action, rec.bucket = None, 2
    rec.record("dp", None, "reduce_scatter", 8, "float32", None)
    assert rec.entries()["phase"] == ["step 5 SendActivation mb1", "step 5 bucket 2"]
    assert pending_call(flight.FlightRecorder()) == "no collective issued yet"


def test_a_drill_fires_once_on_the_nth_matching_call():
    rec = flight.FlightRecorder()
    rec.drill = flight.Drill("all_reduce", "size", nth=1, group="world", recorder=rec)
    t = torch.ones(4)
    assert rec.drill.before("all_reduce", "tp", t) is t  # another group
    assert rec.drill.before("all_reduce", "world", t) is t  # the 0th
    short = rec.drill.before("all_reduce", "world", t)
    assert short.numel() == 3 and short.data_ptr() == t.data_ptr() and rec.drill is None  # disarmed
    skip = flight.Drill("all_reduce", "skip", recorder=rec)
    assert skip.before("all_reduce", "dp", t) is None


def test_stragglers_name_the_rank_with_the_most_own_time_and_its_lag_on_the_median():
    # (data_s, own step_s) per rank; rank 2 reads its data slowly
    got = stragglers([0.01, 0.10, 0.01, 0.11, 0.25, 0.10, 0.01, 0.09])
    assert got["slowest_rank"] == 2 and got["slowest_data_s"] == 0.25
    assert got["slowest_lag"] == pytest.approx(0.35 / 0.115 - 1)


def small(dp=1, pp=1, tp=1, **train):
    rc = tiny_recipe(dp=dp, pp=pp, tp=tp, train__max_steps=3, **train)
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.n_kv_heads, rc.model.seq_len = 2, 32, 2, 2, 16
    rc.train.global_batch = 4
    rc.logger.peak_tflops = 1.0
    rc.parallel.hang_s = HANG_S
    return rc


def _train(rc, run_dir, late=False):
    from recipes.training.trainer import train

    with comm.late_completion() if late else contextlib.nullcontext():
        return train(rc, run_dir)


@pytest.fixture(autouse=True)
def _short_linger(monkeypatch):
    monkeypatch.setattr("recipes.training.watchdog.LINGER_S", 0.5)  # the forked ranks inherit it


def drill(tmp_path, fault: str, late=False, **layout) -> list[str]:
    """Run ``fault`` at ``layout``: the watchdog must end the job (a rank exits with status 1); the
    diagnosis of the dumps it leaves."""
    rc = small(**layout, train__fault=fault)
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    with pytest.raises(RankFailure, match="exit code 1"):
        run_ranks(_train, world, rc, str(tmp_path), late, timeout=90)
    dumps = [json.loads(p.read_text()) for p in sorted((tmp_path / "flight").glob("rank*.json"))]
    assert all(d["reason"].startswith("watchdog: rank ") for d in dumps) and dumps
    return diagnose(tmp_path)


@pytest.mark.parametrize("late", [False, True], ids=["gloo", "late_completion"])
def test_a_rank_that_skips_an_all_reduce_is_named_with_the_call(tmp_path, late):
    """Rank 1 skips step 2's world all-reduce and runs into step 3; under late completion (NCCL's
    semantics: blocking calls return once queued) the peer runs on until it touches the result."""
    lines = drill(tmp_path, "skip_allreduce@1:2", late=late, tp=2)
    assert lines[0] == "2 of 2 ranks dumped (watchdog: 2)"
    assert lines[1] == (
        "group world: ranks [1] never issued collective #4 (all_reduce(1 × float32) on world in step 2) that [0] did"
    ), lines


def test_a_rank_that_sends_another_size_is_named_with_the_call(tmp_path):
    lines = drill(tmp_path, "allreduce_size@1:2", dp=2)
    assert lines[1] == (
        "group world: ranks [1] differ at collective #4: all_reduce(0 × float32) on world in step 2, "
        "where ranks [0] issued all_reduce(1 × float32) on world in step 2"
    ), lines


def test_a_rank_that_hangs_inside_a_pipeline_send_is_named_with_the_transfer(tmp_path):
    lines = drill(tmp_path, "hang_send@0:2", pp=2)
    assert "every group's members issued the same collectives" in lines
    p2p = [line for line in lines if line.startswith("p2p 0 → 1")]
    assert len(p2p) == 1 and p2p[0].startswith("p2p 0 → 1: rank 0 is inside send #2 (step 2 SendActivation mb0)"), lines
    assert any(line.startswith("ranks [0]: inside send #") and "(step 2 SendActivation mb0)" in line for line in lines)


def test_a_straggler_is_named_in_the_metrics_and_the_progress_line(tmp_path, capfd):
    rc = small(dp=2, train__fault="straggle@1:3")
    rc.train.max_steps = 3
    run_ranks(_train, 2, rc, str(tmp_path), timeout=90)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert "slowest_rank" not in rows[0]  # the first logged step has no step time to compare
    last = rows[2]
    # it slept 3 × its step: ≈ 4 steps against 1, and the median of two ranks is their mean: ≈ +60 %
    assert last["slowest_rank"] == 1 and last["slowest_lag"] > 0.4
    assert f"slowest=rank1+{last['slowest_lag']:.0%}" in capfd.readouterr().out


def test_an_out_of_memory_rank_prints_its_bytes_by_kind_beside_the_plan(tmp_path, capfd):
    with pytest.raises(RankFailure, match="OutOfMemoryError"):
        run_ranks(_train, 1, small(train__fault="oom@0:2"), str(tmp_path), timeout=90)
    err = capfd.readouterr().err
    table = err[err.index("rank 0 ran out of memory in step 2") :].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:7]}
    assert list(rows) == ["params", "grads", "optimizer", "activations", "planned"]
    for kind in ("params", "grads", "optimizer"):  # model states: measured = the planner's, to 0.1 MiB
        assert rows[kind][0] == rows[kind][1], table
    assert "no memory snapshot (logger.memory_snapshot=true on CUDA records one)" in err
    assert forensics.start(True, torch.device("cpu")) is False  # the snapshot is CUDA's


def test_sigterm_dumps_the_flight_recorder_at_once_from_the_watcher_thread(tmp_path):
    """The pre-emption watcher wakes on the signal even with the main thread inside C++ and dumps there."""
    import os
    import signal
    import threading

    from recipes.training.checkpointing import Preemption
    from recipes.training.flight import dump_now

    seen = threading.Event()

    def on_signal(name):
        dump_now(tmp_path, name)
        seen.set()

    flight.set_phase("step 7")
    watch = Preemption(30.0, on_signal=on_signal)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen.wait(10)
    finally:
        watch.close()
    dump = json.loads((tmp_path / "flight" / "rank0.json").read_text())
    assert dump["reason"] == "SIGTERM" and dump["phase"] == "step 7" and watch.flag
    assert dump_now(tmp_path, "watchdog: rank 0 made no progress") is not None
    assert dump_now(tmp_path, "SIGTERM") is None  # the launcher stopping the job: the watchdog's reason stays
    assert json.loads((tmp_path / "flight" / "rank0.json").read_text())["reason"].startswith("watchdog")
