"""Save on one layout, load on another; atomic publish; damage detection; pruning."""

import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.checkpoint import (
    CheckpointError,
    Chunked,
    find_damage,
    flat_range_boxes,
    latest_checkpoint,
    load_checkpoint,
    published,
    read_dcp_metadata,
    save_checkpoint,
    to_global,
    tp_placement,
    verify_checkpoint,
)
from parallel.testing import RankFailure, run_ranks

SHAPE = (6, 5)


def reference(step: int) -> torch.Tensor:
    return torch.arange(30, dtype=torch.float32).view(SHAPE) * step


def flat_half_state(step: int) -> dict:
    """ZeRO-like: rank r holds the r-th half of the flattened tensor (5 boxes' worth, not a block)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 30 // world
    flat = reference(step).reshape(-1)[rank * n : (rank + 1) * n].clone()
    w = Chunked(SHAPE, torch.float32)
    start = 0
    for off, size in flat_range_boxes(SHAPE, rank * n, (rank + 1) * n):
        k = torch.Size(size).numel()
        w.add(off, flat[start : start + k].view(size))
        start += k
    return {"w": w, "step": torch.tensor(float(step))}


def _save(root, steps, keep=0, kill_rank_at=None):
    for step in steps:
        kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if kill_rank_at == (dist.get_rank(), step) else None
        save_checkpoint(flat_half_state(step), root, step, meta={"note": "test"}, keep=keep, on_written=kill)


def _load_columns(ckpt):
    """Another layout: rank r holds column block r (TP-like), plus the replicated scalar."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cols = SHAPE[1] // world if SHAPE[1] % world == 0 else None
    local = torch.zeros(SHAPE[0], cols) if cols else torch.zeros(SHAPE)
    place = tp_placement(local.shape, 1 if cols else None, rank, world if cols else 1)
    w = Chunked(place.global_shape, torch.float32)
    w.add(to_global(((0, 0), tuple(local.shape)), place)[0], local)
    state = {"w": w, "step": torch.tensor(0.0)}
    manifest = load_checkpoint(state, ckpt)
    return local, state["step"].item(), manifest["step"]


def _verify(ckpt):
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as e:
        return str(e)
    return "intact"


def test_two_ranks_save_flat_halves_one_rank_reads_it_whole(tmp_path):
    run_ranks(_save, 2, tmp_path, [3])
    ((local, step, saved_step),) = run_ranks(_load_columns, 1, latest_checkpoint(tmp_path))
    assert torch.equal(local, reference(3)) and step == 3.0 and saved_step == 3


def test_rows_split_saved_then_read_as_column_blocks(tmp_path):
    run_ranks(_save, 3, tmp_path, [2])  # 30 elements in thirds: partial rows on every rank
    got = run_ranks(_load_columns, 1, latest_checkpoint(tmp_path))[0][0]
    assert torch.equal(got, reference(2))


def test_kill_during_save_leaves_previous_checkpoint_published(tmp_path):
    run_ranks(_save, 2, tmp_path, [1])
    with pytest.raises(RankFailure):  # rank 1's death, or rank 0's barrier failing on it: whichever is seen first
        run_ranks(_save, 2, tmp_path, [2], kill_rank_at=(1, 2), timeout=60)
    assert (tmp_path / ".tmp-step_00000002").is_dir()  # it did die while writing step 2
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert [p.name for p in published(tmp_path)] == ["step_00000001"]
    local, step, _ = run_ranks(_load_columns, 1, latest_checkpoint(tmp_path))[0]
    assert torch.equal(local, reference(1)) and step == 1.0
    run_ranks(_save, 2, tmp_path, [3])  # the next save cleans up (any step) and publishes
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert not (tmp_path / ".tmp-step_00000002").exists()


def test_keep_last_k(tmp_path):
    run_ranks(_save, 2, tmp_path, [1, 2, 3, 4], keep=2)
    assert [p.name for p in published(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_corrupted_and_truncated_shards_are_named_on_every_rank(tmp_path):
    run_ranks(_save, 2, tmp_path, [1])
    ckpt = latest_checkpoint(tmp_path)
    assert find_damage(ckpt) == []
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    errors = run_ranks(_verify, 2, ckpt)
    assert any("__1_0.distcp" in e and "corrupted" in e for e in errors)
    assert all(e != "intact" for e in errors)  # the rank that did not read it fails too
    shard.write_bytes(bytes(data[:100]))
    assert all("__1_0.distcp" in e and "truncated" in e for e in run_ranks(_verify, 2, ckpt))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_with_foreign_classes_is_not_unpickled(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        read_dcp_metadata(tmp_path)


def _save_with_a_slow_rank(root, slow_rank, slow_part):
    """Save under NCCL-like late completion while one rank lags in one part of the save; return
    whether every rank, once save_checkpoint returned, sees that very checkpoint published."""
    from parallel.checkpoint import store

    if dist.get_rank() == slow_rank:
        real = getattr(store, slow_part)

        def slow(*args):
            time.sleep(0.5)
            return real(*args)

        setattr(store, slow_part, slow)
    with comm.late_completion():
        final = save_checkpoint(flat_half_state(1), root, 1)
        return latest_checkpoint(root) == final


@pytest.mark.parametrize(
    "slow_rank, slow_part",
    [
        (1, "_digest"),  # rank 0 must not read sums.1.json before rank 1 wrote it
        (0, "prune"),  # rank 1 must not return before rank 0 moved `latest`
    ],
)
def test_publication_waits_for_every_rank_when_collectives_complete_late(tmp_path, slow_rank, slow_part):
    assert run_ranks(_save_with_a_slow_rank, 2, tmp_path, slow_rank, slow_part, timeout=60) == [True, True]
