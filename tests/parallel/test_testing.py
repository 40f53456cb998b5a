"""The multi-process harness itself: failures surface fast and name the rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from parallel.testing import RankFailure, run_ranks


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum_ranks, 3) == [(3.0, 0, 3), (3.0, 1, 3), (3.0, 2, 3)]


def _raise_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("bad shard on rank two")
    dist.barrier()  # the others would wait forever


def test_a_raising_rank_fails_fast_with_its_traceback():
    with pytest.raises(RankFailure) as e:  # a raise, not the 30 s timeout: the message says which
        run_ranks(_raise_on_rank_2, 4, timeout=30)
    assert e.value.rank == 2
    assert "rank 2 of 4 raised" in str(e.value)
    assert "ValueError: bad shard on rank two" in str(e.value)
    assert "_raise_on_rank_2" in str(e.value)  # the traceback, not just the message


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def test_a_hanging_rank_fails_after_the_timeout_and_leaves_no_process():
    before = set(os.listdir("/proc")) if os.path.isdir("/proc") else set()
    with pytest.raises(RankFailure) as e:
        run_ranks(_hang_on_rank_1, 2, timeout=2)
    assert "did not finish within 2 s" in str(e.value)
    assert "_hang_on_rank_1" in str(e.value)  # each hung rank's stack is shown
    if before:
        children = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _parent(p) == os.getpid()]
        assert children == []


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _die_hard():
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def test_a_rank_that_dies_silently_is_reported_with_its_exit_code():
    with pytest.raises(RankFailure, match=r"rank 0 of 2 died without answering \(exit code 7\)"):
        run_ranks(_die_hard, 2, timeout=30)
