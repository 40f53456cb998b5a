"""Background checkpoints through the trainer: the same checkpoint and the same resume as a
synchronous save, and a writer that fails ends the job with its traceback."""

import pytest

from parallel.checkpoint import latest_checkpoint, read_manifest
from parallel.testing import RankFailure, run_ranks

from .test_faults import metrics, small_recipe
from .test_train_e2e import _train, losses


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same 4-step job saving at steps 2 and 4, in the background and synchronously."""
    dirs = {}
    for mode in (True, False):
        d = tmp_path_factory.mktemp(f"async_{mode}")
        run_ranks(
            _train,
            2,
            small_recipe(train__max_steps=4, train__ckpt_every=2, train__ckpt_async=mode),
            str(d),
            timeout=120,
        )
        dirs[mode] = d
    return dirs


def test_background_checkpoints_are_the_synchronous_ones(both):
    assert losses(both[True]) == losses(both[False])
    for step in ("step_00000002", "step_00000004"):
        a, s = (read_manifest(both[m] / "checkpoints" / step) for m in (True, False))
        assert {k: v for k, v in a["files"].items() if k.endswith(".distcp")} == {
            k: v for k, v in s["files"].items() if k.endswith(".distcp")
        }  # every shard: same size, same CRC32
        assert a["step"] == s["step"] and a["meta"]["layout"] == s["meta"]["layout"]
    assert latest_checkpoint(both[True] / "checkpoints").name == "step_00000004"  # the end waited for it


def test_resume_from_a_background_checkpoint_equals_resume_from_a_synchronous_one(both, tmp_path):
    got = {}
    for mode in (True, False):
        run_dir = tmp_path / str(mode)
        ckpt = both[mode] / "checkpoints" / "step_00000002"
        run_ranks(_train, 2, small_recipe(train__max_steps=4, train__resume=str(ckpt)), str(run_dir), timeout=120)
        got[mode] = losses(run_dir)
    assert got[True] == got[False]
    assert got[True][0] == losses(both[True])[0][2:]  # steps 3 and 4, bit for bit


def test_failing_background_writer_ends_the_job_at_the_next_step_with_its_traceback(tmp_path):
    rc = small_recipe(train__max_steps=6, train__ckpt_every=2, train__fault="raise_in_save@0:2")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train, 2, rc, str(tmp_path), timeout=120)
    text = str(failure.value)
    assert "rank 0" in text and "background save of step 2 failed" in text
    assert "fault drill: rank 0 raises while saving step 2" in text  # the writer's own traceback, chained
    assert "write_shards" in text
    assert latest_checkpoint(tmp_path / "checkpoints") is None  # never published
    # raised by the first poll after the writer failed (a step or two on this machine), not at the end
    assert 2 <= len(metrics(tmp_path)) < 6
