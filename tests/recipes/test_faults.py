"""Faults end the job promptly, name the rank, and a restarted job resumes by itself.

The launcher tests run the real elastic agent (``launch.local.spawn_local``, the
code torchrun runs) with spawned workers: they are about processes.
"""

import json
import time

import pytest
import torch

from launch.local import spawn_local
from parallel import comm
from parallel.checkpoint import latest_checkpoint
from parallel.groups import build_groups
from parallel.testing import run_ranks
from parallel.topology import Topology
from recipes.main import worker

from .test_train_e2e import _train, tiny_recipe


def small_recipe(**kw):
    """Two DP ranks of a 2-layer, d_model 32 GPT: the cheapest job that still communicates."""
    rc = tiny_recipe(dp=2, zero=1, **kw)
    rc.model.n_layers, rc.model.d_model, rc.model.n_heads, rc.model.n_kv_heads, rc.model.seq_len = 2, 32, 2, 2, 16
    rc.train.global_batch = 4
    rc.logger.peak_tflops = 1.0  # skip measuring the CPU
    rc.train.sigterm_grace_s = 5.0
    return rc


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _stalled_peer(timeout_s):
    groups = build_groups(Topology(2, 1, 1), timeout_s=timeout_s)
    if groups.rank == 1:
        time.sleep(4 * timeout_s)  # never joins
        return None
    t0 = time.perf_counter()
    try:
        comm.all_reduce(torch.ones(4), group=groups.dp)
    except Exception as e:  # noqa: BLE001 - the point is that it raises
        return time.perf_counter() - t0, str(e)
    return None


def test_collective_times_out_after_the_configured_seconds():
    elapsed, message = run_ranks(_stalled_peer, 2, 1.0, timeout=30)[0]
    assert 0.9 < elapsed < 3.0, message


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind, says", [("raise", "fault drill: rank 1 raises at step 2"),
                                        ("kill", "Signal 9 (SIGKILL)")])
def test_failing_rank_ends_the_job_naming_it(tmp_path, kind, says):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    rc = small_recipe(train__max_steps=50, train__fault=f"{kind}@1:2")
    t0 = time.perf_counter()
    with pytest.raises(ChildFailedError) as err:
        spawn_local(worker, 2, rc, str(tmp_path))
    elapsed = time.perf_counter() - t0
    text = str(err.value)
    assert "rank      : 1" in text and says in text, text
    assert len(metrics(tmp_path)) == 1  # step 1 ran, then the job ended: no survivor went on
    assert elapsed < 90  # the start of two spawned workers dominates; a hang would hit the timeout


@pytest.mark.timeout(240)
def test_sigkilled_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    rc = small_recipe(train__max_steps=4, train__ckpt_every=2, train__resume="auto", train__fault="kill@1:3")
    results = spawn_local(worker, 2, rc, str(tmp_path), max_restarts=1)
    assert results[0]["steps"] == 4
    steps = [m["step"] for m in metrics(tmp_path)]
    assert steps == [1, 2, 3, 4]  # attempt 0 logged 1–2 and died starting 3; attempt 1 resumed at 2
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


def test_sigterm_on_one_rank_checkpoints_and_stops_every_rank(tmp_path):
    rc = small_recipe(train__max_steps=6, train__fault="term@1:3")
    summaries = run_ranks(_train, 2, rc, str(tmp_path), timeout=120)
    assert [s["steps"] for s in summaries] == [3, 3] and all(s["preempted"] for s in summaries)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000003"


def test_kill_while_saving_keeps_the_previous_checkpoint_for_resume(tmp_path):
    from parallel.testing import RankFailure

    rc = small_recipe(train__max_steps=4, train__ckpt_every=2, train__fault="kill_in_save@1:4")
    with pytest.raises(RankFailure):
        run_ranks(_train, 2, rc, str(tmp_path), timeout=120)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    rc = small_recipe(train__max_steps=4, train__ckpt_every=2, train__resume="auto")
    assert run_ranks(_train, 2, rc, str(tmp_path), timeout=120)[0]["steps"] == 4
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4, 3, 4]
