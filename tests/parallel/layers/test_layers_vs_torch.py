"""Each parallel layer against PyTorch's own single-device op, at tp=2 and without a group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import comm
from parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_tensor,
    mean_token_cross_entropy,
    vocab_parallel_cross_entropy,
)
from parallel.params import tp_shard_dim
from parallel.testing import run_ranks


def _ref(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load_shard(param, full, group):
    with torch.no_grad():
        dim = tp_shard_dim(param)
        param.copy_(full if dim is None else comm.split_along(full, dim, group))


def _linear_rank():
    group = dist.new_group([0, 1], group_desc="tp")
    w1, b1, w2, b2, x = _ref(1, 12, 8), _ref(2, 12), _ref(3, 8, 12), _ref(4, 8), _ref(5, 2, 3, 8)
    col = ColumnParallelLinear(8, 12, tp_group=group, gather_output=True)
    row = RowParallelLinear(12, 8, tp_group=group, input_is_parallel=False)
    for p, full in ((col.weight, w1), (col.bias, b1), (row.weight, w2), (row.bias, b2)):
        _load_shard(p, full, group)
    y = row(torch.relu(col(x)))
    y.square().sum().backward()
    return y.detach(), [gather_full_tensor(p, group, data=p.grad) for p in (col.weight, col.bias, row.weight, row.bias)]


def test_column_then_row_parallel_linear_equal_torch_linear():
    ps = [_ref(s, *shape).requires_grad_() for s, shape in ((1, (12, 8)), (2, (12,)), (3, (8, 12)), (4, (8,)))]
    y = F.linear(torch.relu(F.linear(_ref(5, 2, 3, 8), ps[0], ps[1])), ps[2], ps[3])
    y.square().sum().backward()
    for out, grads in run_ranks(_linear_rank, 2):
        torch.testing.assert_close(out, y.detach())
        for g, p in zip(grads, ps):  # gradients reach ~800: fp32 sums in another order differ by ~1e-5
            torch.testing.assert_close(g, p.grad, rtol=1.3e-6, atol=1e-7 * p.grad.abs().max().item())


def _ce_rank(logits, targets, vocab):
    group = dist.new_group([0, 1], group_desc="tp")
    local = comm.split_along(logits, -1, group).requires_grad_()
    emb = VocabParallelEmbedding(logits.shape[-1], 4, tp_group=group, vocab_size=vocab)
    _load_shard(emb.weight, _ref(9, logits.shape[-1], 4), group)
    loss = vocab_parallel_cross_entropy(local, targets, group, vocab_size=vocab)
    loss.sum().backward()
    return loss.detach(), comm.all_gather_along(local.grad, -1, group), emb(targets.clamp(min=0)).detach()


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_cross_entropy_and_embedding_equal_torch(tp):
    vocab, padded = 10, 16  # columns 10..15 are padding: they must neither win nor count
    logits = _ref(6, 3, 5, padded) * 3
    logits[..., vocab:] = 50.0  # would dominate if they counted
    targets = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(8))
    targets[0, 0] = -100
    ref_logits = logits[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.transpose(1, 2), targets, reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 5, padded - vocab)], -1)
    ref_emb = F.embedding(targets.clamp(min=0), _ref(9, padded, 4))
    if tp == 1:
        local = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, vocab_size=vocab)
        loss.sum().backward()
        results = [(loss.detach(), local.grad, None)]
    else:
        results = run_ranks(_ce_rank, 2, logits, targets, vocab)
    for loss, grad, emb in results:
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grad, ref_grad)
        if emb is not None:
            torch.testing.assert_close(emb, ref_emb)


def test_mean_token_cross_entropy_is_the_per_token_mean_counting_ignored_tokens():
    # tp=1 takes one fused sum / token count: the same value and gradient as the per-token loss's
    # mean, an ignored token counting as a zero (F.cross_entropy's own mean divides by 14, not 15)
    vocab, padded = 10, 16
    logits = _ref(6, 3, 5, padded) * 3
    logits[..., vocab:] = 50.0
    targets = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(8))
    targets[0, 0] = -100
    ref_logits, ours_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = vocab_parallel_cross_entropy(ref_logits, targets, vocab_size=vocab).mean()
    ref.backward()
    loss = mean_token_cross_entropy(ours_logits, targets, vocab_size=vocab)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ours_logits.grad, ref_logits.grad)
    assert ours_logits.grad[..., vocab:].abs().sum() == 0  # padding columns neither win nor count
    torch_mean = F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), targets.reshape(-1))
    assert loss.item() == pytest.approx(torch_mean.item() * 14 / 15, rel=1e-6)
    from parallel.layers import LayerConfigError

    with pytest.raises(LayerConfigError, match="vocab_size 17 exceeds the 16 logits columns"):
        mean_token_cross_entropy(logits, targets, vocab_size=17)  # the fused path checks as the per-token one
    with pytest.raises(LayerConfigError, match="disagree"):
        mean_token_cross_entropy(logits, targets[:, :4], vocab_size=vocab)


def test_row_parallel_linear_without_group_is_torch_linear():
    w, b, x = _ref(1, 8, 12).requires_grad_(), _ref(2, 8).requires_grad_(), _ref(3, 2, 3, 12)
    F.linear(x, w, b).square().sum().backward()
    row = RowParallelLinear(12, 8)
    with torch.no_grad():
        row.weight.copy_(w)
        row.bias.copy_(b)
    y = row(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, F.linear(x, w, b))
    torch.testing.assert_close(row.weight.grad, w.grad)
    torch.testing.assert_close(row.bias.grad, b.grad)


def test_out_of_vocabulary_ids_and_targets_are_refused_with_their_span_on_the_host_batch():
    from parallel.layers import LayerConfigError, check_token_ids

    with pytest.raises(LayerConfigError, match=r"targets span \[0, 9\].*\[0, 8\)"):
        check_token_ids(torch.tensor([[1, -100, 9], [0, 1, 2]]), 8, what="targets", ignore_index=-100)
    with pytest.raises(LayerConfigError, match=r"token ids span \[-1, 1\]"):
        check_token_ids(torch.tensor([[1, -1]]), 8)
    with pytest.raises(LayerConfigError, match="must be integers"):
        check_token_ids(torch.tensor([1.0]), 8)
    with pytest.raises(LayerConfigError, match="host batch"):
        check_token_ids(torch.tensor([1], device="meta"), 8)
    check_token_ids(torch.full((2, 3), -100), 8, ignore_index=-100)  # every target ignored: accepted
    # every target ignored: loss 0
    assert vocab_parallel_cross_entropy(torch.randn(2, 3, 8), torch.full((2, 3), -100)).abs().sum() == 0


def test_a_steps_ids_checked_together_are_refused_as_one_by_one():
    """The trainer checks a step's inputs and targets in one pass (issue 17): a bad id in any
    micro-batch's inputs or targets is refused with check_token_ids' own message for that tensor."""
    from parallel.layers import LayerConfigError, check_token_ids, check_token_ids_together

    def step(bad_at=None, value=8):
        mbs = [(torch.arange(6).view(2, 3) + i, torch.arange(1, 7).view(2, 3)) for i in range(3)]
        named = [(t.clone(), what) for x, y in mbs for t, what in ((x, "token ids"), (y, "targets"))]
        if bad_at is not None:
            named[bad_at][0][1, 0] = value
        return named

    check_token_ids_together(step(), 9)  # the largest id, 7 + 1, is in range
    check_token_ids_together([], 9)
    for bad_at in range(6):
        for value in (-3, 9):
            named = step(bad_at, value)
            with pytest.raises(LayerConfigError) as one:
                check_token_ids(*named[bad_at][:1], 9, what=named[bad_at][1])
            with pytest.raises(LayerConfigError) as together:
                check_token_ids_together(named, 9)
            assert str(together.value) == str(one.value)
            assert ("targets" if bad_at % 2 else "token ids") + " span" in str(together.value)
    with pytest.raises(LayerConfigError, match="must be integers"):
        check_token_ids_together([(torch.zeros(2), "token ids")], 9)
    with pytest.raises(LayerConfigError, match="host batch"):
        check_token_ids_together(step()[:1] + [(torch.ones(2, dtype=torch.long, device="meta"), "targets")], 9)
