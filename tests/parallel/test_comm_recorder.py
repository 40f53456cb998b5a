"""The call recorder: device check and call-sequence agreement (issue 12 §1)."""

import torch
import torch.distributed as dist

from parallel import comm
from parallel.comm import Call, CallRecorder, compare_sequences
from parallel.testing import run_ranks


def _collectives_with_a_stray_cpu_tensor():
    me = dist.get_rank()
    as_if_gpu = CallRecorder(device=torch.device("meta"))  # the rank computes on another device than the CPU
    default = CallRecorder()  # device_for(group): the CPU under gloo
    with as_if_gpu, default:
        comm.all_reduce(torch.ones(3))
        out = torch.empty(4)
        comm.all_gather(out, torch.ones(2))
        if me == 0:
            comm.send(torch.ones(5, dtype=torch.bfloat16), dst=1)
        else:
            comm.recv(torch.empty(5, dtype=torch.bfloat16), src=0)
    return as_if_gpu.misplaced(), default.misplaced(), default.calls


def test_a_cpu_tensor_in_a_collective_is_flagged_when_the_rank_computes_elsewhere():
    for rank, (flagged, clean, calls) in enumerate(run_ranks(_collectives_with_a_stray_cpu_tensor, 2)):
        assert len(flagged) == 3 and "all_reduce(3 × float32) on world got a tensor on cpu" in flagged[0]
        assert "the rank computes on meta" in flagged[0]
        assert clean == []  # under gloo the CPU is the rank's device
        assert [(c.op, c.numel, c.dtype, c.ranks) for c in calls[:2]] == [
            ("all_reduce", 3, "float32", (0, 1)),
            ("all_gather", 4, "float32", (0, 1)),
        ]
        assert calls[2].op == ("send" if rank == 0 else "recv") and calls[2].peer == 1 - rank


def _call(op, numel, dtype="bfloat16", group="tp", ranks=(0, 1), peer=None):
    return Call(group, ranks, op, numel, dtype, "meta", peer)


def test_matching_sequences_pass():
    a = [_call("all_reduce", 8), _call("send", 4, group="pp", ranks=(0, 2), peer=2)]
    b = [_call("all_reduce", 8)]
    c = [_call("recv", 4, group="pp", ranks=(0, 2), peer=0)]
    assert compare_sequences({0: a, 1: b, 2: c}) == []


def test_a_mismatched_collective_is_reported_with_the_first_differing_call():
    a = [_call("all_reduce", 8), _call("all_gather", 16), _call("reduce_scatter", 16)]
    b = [_call("all_reduce", 8), _call("all_gather", 16, dtype="float32"), _call("reduce_scatter", 16)]
    problems = compare_sequences({0: a, 1: b})
    assert problems == [
        (
            "group tp [0, 1]: ranks 0 and 1 differ at collective 1: all_gather(16 × bfloat16) on tp "
            "vs all_gather(16 × float32) on tp"
        )
    ]
    missing = compare_sequences({0: a, 1: a[:2]})  # one member skips the last collective: a hang on NCCL
    assert missing and "collective 2: reduce_scatter(16 × bfloat16) on tp vs nothing" in missing[0]


def test_unpaired_p2p_is_reported():
    send = [_call("send", 4, group="pp", ranks=(0, 1), peer=1), _call("send", 4, group="pp", ranks=(0, 1), peer=1)]
    recv = [_call("recv", 4, group="pp", ranks=(0, 1), peer=0)]
    problems = compare_sequences({0: send, 1: recv})
    assert problems == ["p2p 0 → 1: send 1 is send(4 × bfloat16) on pp peer 1, the matching receive is nothing"]
