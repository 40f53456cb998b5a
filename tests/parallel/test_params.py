import torch

from parallel import params


def test_marks_survive_and_default_to_replicated():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    assert params.tp_shard_dim(p) is None and params.is_tp_replicated(p)
    assert not params.is_sequence_parallel(p) and not params.is_shared_embedding(p)
    assert params.wants_weight_decay(p)
    params.mark_tp_sharded(p, 1)
    params.mark_sequence_parallel(p)
    params.mark_shared_embedding(p)
    params.mark_no_weight_decay(p)
    m = torch.nn.Module()
    m.w = p
    (q,) = list(m.parameters())
    assert params.tp_shard_dim(q) == 1 and not params.is_tp_replicated(q)
    assert params.is_sequence_parallel(q) and params.is_shared_embedding(q)
    assert not params.wants_weight_decay(q)
