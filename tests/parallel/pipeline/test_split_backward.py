"""Zero-bubble's split backward (parallel/pipeline/split_backward.py) with nodes that compute their weight
gradients in B whatever autograd asks (an ``autograd.Function``, a ``torch.compile``'d block): B keeps
them, W does not run the node again, and saved tensors several nodes read (activation checkpointing) are
released after the last of them."""

import contextlib

import pytest
import torch
from torch import nn

from parallel.pipeline.split_backward import SavedTensorStash, backward_input, backward_weight

from .test_zero_bubble import _Count, _matmuls, _Net


class _FusedTanhLinear(torch.autograd.Function):
    """``tanh(x Wᵀ)``, whose backward computes dx and dW together whatever autograd needs (as a
    ``torch.compile``'d block does); ``calls`` counts its backwards."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x @ w.t())
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        _FusedTanhLinear.calls += 1
        x, w, y = ctx.saved_tensors
        g = gy * (1 - y * y)
        return g @ w, g.flatten(0, -2).t() @ x.flatten(0, -2)


class _FusedNet(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = nn.Parameter(torch.randn(d, d) / d), nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        return _FusedTanhLinear.apply(_FusedTanhLinear.apply(x, self.w1) + x, self.w2)


@pytest.mark.parametrize("stash", [False, True])
def test_a_node_that_computes_its_weight_gradient_in_b_is_not_run_again_in_w(stash):
    x0, gy = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), torch.randn(2, 3, 8)
    ref, x = _FusedNet(), x0.clone().requires_grad_()
    ref(x).backward(gy)
    net, xs = _FusedNet(), x0.clone().requires_grad_()
    keep = SavedTensorStash() if stash else None
    with keep.hooks() if keep else contextlib.nullcontext():
        out = net(xs)
    _FusedTanhLinear.calls = 0
    dx, work = backward_input(out, gy, xs, net.parameters(), keep)
    assert _FusedTanhLinear.calls == 2 and all(p.grad is None for p in net.parameters())
    backward_weight(work)
    assert _FusedTanhLinear.calls == 2  # W started below both nodes: no backward ran twice
    torch.testing.assert_close(dx, x.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_compiled_block_under_zero_bubble_runs_its_backward_once():
    torch._dynamo.reset()
    x0, gy = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), torch.randn(2, 3, 8)
    ref, x = _Net(False), x0.clone().requires_grad_()
    ref(x).backward(gy)
    net, xs = _Net(False), x0.clone().requires_grad_()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    out = compiled(xs)
    with _Count() as b_ops:
        dx, work = backward_input(out, gy, xs, net.parameters())
    with _Count() as w_ops:
        backward_weight(work)
    again = _Net(False)(x0.clone().requires_grad_())
    with _Count() as full:
        again.backward(gy)
    assert _matmuls(b_ops.ops) == _matmuls(full.ops) == 4 and _matmuls(w_ops.ops) == 0  # B did it all, once
    torch.testing.assert_close(dx, x.grad)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _CheckpointedFusedNet(nn.Module):
    """Two blocks under non-reentrant activation checkpointing, each with a norm, a node that computes its
    weight gradient in B (:class:`_FusedTanhLinear`) and a linear: every node of a block reads the block's
    input through the checkpoint (recomputation), so those saved tensors have several readers."""

    def __init__(self, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(d, d) / d) for _ in range(2))
        self.lin = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for w, lin, norm in zip(self.w, self.lin, self.norm):
            x = checkpoint(
                lambda h, w=w, lin=lin, norm=norm: h + lin(_FusedTanhLinear.apply(norm(h), w)), x, use_reentrant=False
            )
        return x


def test_a_saved_tensor_several_nodes_read_is_released_after_the_last_of_them():
    x0, gy = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), torch.randn(2, 3, 8)
    ref, x = _CheckpointedFusedNet(), x0.clone().requires_grad_()
    ref(x).backward(gy)
    net, xs, keep = _CheckpointedFusedNet(), x0.clone().requires_grad_(), SavedTensorStash()
    with keep.hooks():
        out = net(xs)
    dx, work = backward_input(out, gy, xs, net.parameters(), keep)
    backward_weight(work)
    torch.testing.assert_close(dx, x.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
