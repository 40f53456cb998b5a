"""Background saves: the checkpoint of the moment save() returned, published only when every
rank's writer is done, identical to a synchronous save; a failing writer is never silent."""

import traceback

import torch
import torch.distributed as dist

from parallel.checkpoint import (
    BackgroundSaver,
    CheckpointError,
    latest_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from parallel.testing import run_ranks

from .test_store import _load_columns, flat_half_state


def _background_then_sync(root_async, root_sync):
    saver = BackgroundSaver(timeout_s=60)
    state = flat_half_state(3)
    path = saver.save(state, root_async, 3, meta={"note": "test"}, keep=2)
    # training goes on at once: the live tensors change while the writer runs
    for view in state["w"].pieces.values():
        view.mul_(-1)
    state["step"].fill_(-1)
    assert saver.wait() == path  # published, with the values of the moment save() returned
    save_checkpoint(flat_half_state(3), root_sync, 3, meta={"note": "test"}, keep=2)
    dist.barrier()
    a, b = latest_checkpoint(root_async), latest_checkpoint(root_sync)
    verify_checkpoint(a)  # sizes and CRC32s of every file
    got_async, got_sync = _load_columns(a), _load_columns(b)
    ma, mb = read_manifest(a), read_manifest(b)
    same_files = {k: v["bytes"] for k, v in ma["files"].items()} == {k: v["bytes"] for k, v in mb["files"].items()}
    shards_equal = all(ma["files"][k]["crc32"] == mb["files"][k]["crc32"] for k in ma["files"] if k.endswith(".distcp"))
    # a second save waits for nothing (none under way) and the thread's group is its own
    saver.save(flat_half_state(5), root_async, 5, keep=2)
    second = saver.wait()
    return got_async, got_sync, same_files, shards_equal, a.name, second.name, saver.stall_s


def test_background_save_equals_a_synchronous_one(tmp_path):
    results = run_ranks(_background_then_sync, 2, tmp_path / "a", tmp_path / "s", timeout=120)
    for (loc_a, step_a, man_a), (loc_s, step_s, man_s), same_files, shards_equal, name, second, _ in results:
        torch.testing.assert_close(loc_a, loc_s, rtol=0, atol=0)
        assert step_a == step_s == 3.0 and man_a == man_s == 3
        assert same_files and shards_equal and name == "step_00000003" and second == "step_00000005"
    assert latest_checkpoint(tmp_path / "a").name == "step_00000005"


def _failing_writer(root):
    saver = BackgroundSaver(timeout_s=60)

    def disk_full():
        raise OSError(28, "No space left on device (simulated)")

    saver.save(flat_half_state(2), root, 2, on_written=disk_full)
    try:
        while saver.poll() is None:  # the training loop polls every step
            pass
    except CheckpointError as e:
        cause = e.__cause__
        return (
            str(e),
            type(cause).__name__,
            "disk_full" in "".join(traceback.format_tb(cause.__traceback__)),
        )
    return None


def test_a_failing_writer_raises_in_the_training_thread_with_its_traceback(tmp_path):
    for got in run_ranks(_failing_writer, 2, tmp_path, timeout=120):
        assert got is not None, "the failure was lost"
        message, cause, traceback_kept = got
        assert "background save of step 2 failed" in message and "No space left" in message
        assert cause == "OSError" and traceback_kept
    assert latest_checkpoint(tmp_path) is None  # nothing published
