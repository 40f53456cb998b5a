"""The experts' grouped matmuls (parallel/layers/grouped_mm.py): every way equals the loop, forward and
backward (fp32, uneven segments with empty ones), with and without biases; unaligned operands fall back;
the way is chosen once per device type (on meta, the GPU's); torch's FLOP counter counts the grouped kernel."""

import pytest
import torch

from parallel.layers import grouped_mm
from parallel.layers.grouped_mm import CPU_KIND, KINDS, Segments, expert_matmul_kind, grouped_fits
from parallel.layers.moe import GroupedExperts

SIZES = [0, 5, 0, 13, 1, 7, 0]  # empty first, middle and last segments


def _grads(experts: GroupedExperts, sizes: list[int], kind: str, d: int):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(sizes), d, generator=gen, requires_grad=True)
    y = experts(x, sizes, kind)
    y.backward(torch.randn(y.shape, generator=gen))
    out = [y.detach(), x.grad, *(p.grad for p in experts.parameters())]
    experts.zero_grad()
    return out


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "loop"])
@pytest.mark.parametrize(
    "activation,bias,d,f", [("swiglu", False, 16, 24), ("gelu", True, 8, 12), ("swiglu", False, 6, 10)]
)
def test_every_way_equals_the_loop_forward_and_backward(kind, activation, bias, d, f):
    torch.manual_seed(0)
    experts = GroupedExperts(len(SIZES), d, f, activation=activation, bias=bias)
    want = _grads(experts, SIZES, "loop", d)
    for sizes in (SIZES, [0] * len(SIZES)):  # and no rows at all
        got = _grads(experts, sizes, kind, d)
        ref = want if sizes is SIZES else _grads(experts, sizes, "loop", d)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unaligned_or_unsupported_operands_fall_back_to_the_loop(monkeypatch):
    assert grouped_fits(torch.empty(3, 16), torch.empty(2, 16, 24))
    assert not grouped_fits(torch.empty(3, 6), torch.empty(2, 6, 10))  # rows of 24 and 40 bytes
    assert not grouped_fits(torch.empty(3, 16), torch.empty(2, 16, 24, dtype=torch.float64))
    calls = []
    monkeypatch.setattr(grouped_mm, "_grouped_mm", lambda *a, **k: calls.append(1))
    x, w = torch.randn(4, 6), torch.randn(2, 6, 10)
    y = Segments.of([1, 3], x, "grouped").mm(x, w)
    assert not calls and torch.equal(y, torch.cat([x[:1] @ w[0], x[1:] @ w[1]]))


def test_the_way_is_chosen_once_per_device_type():
    assert expert_matmul_kind("cpu") == CPU_KIND in KINDS
    assert expert_matmul_kind.cache_info().hits >= 0
    before = expert_matmul_kind.cache_info().misses
    expert_matmul_kind("cpu")
    assert expert_matmul_kind.cache_info().misses == before  # cached: decided once
    assert expert_matmul_kind("meta") == "grouped"  # the dry run's GPU


def _ops(experts: int, dtype: torch.dtype) -> list[str]:
    """The aten ops one forward + backward of ``experts`` meta experts dispatches (uneven segments)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    seen: list[str] = []
    with torch.device("meta"):
        layer = GroupedExperts(experts, 16, 24, activation="swiglu", bias=False).to(dtype)
    sizes = [3 * (i % 3) for i in range(experts)]
    x = torch.empty(sum(sizes), 16, device="meta", dtype=dtype, requires_grad=True)
    with Ops():
        layer(x, sizes).sum().backward()
    return seen


def test_on_meta_the_experts_run_the_gpus_kernel_in_as_many_ops_whatever_their_number():
    """The dry run (meta tensors) of a rank holding many experts (DeepSeek-V3: 256 / ep) costs what one
    holding few does: bf16 runs the grouped kernel, as a GPU does; fp32 the GPU's fallback, the loop."""
    few, many = _ops(4, torch.bfloat16), _ops(32, torch.bfloat16)
    assert few == many and "aten._grouped_mm" in few
    assert "aten._grouped_mm" not in _ops(4, torch.float32) and len(_ops(32, torch.float32)) > len(few)


def test_the_flop_counter_counts_grouped_matmuls_as_the_loop():
    """torch's FlopCounterMode has no formula for the grouped kernel (the planner's FLOPs against it,
    benchmarks/deepseek_flops.py, read 1.25-2.0 instead of 1.01-1.07): forward and backward as the loop."""
    from torch.utils.flop_counter import FlopCounterMode

    experts = GroupedExperts(len(SIZES), 16, 24, activation="swiglu", bias=False)
    counted = {}
    for kind in ("grouped", "loop"):
        with FlopCounterMode(display=False) as counter:
            _grads(experts, SIZES, kind, 16)
        counted[kind] = counter.get_total_flops()
    assert counted["grouped"] == counted["loop"] == 3 * 2 * 3 * sum(SIZES) * 16 * 24  # 3 matmuls, fwd + 2 bwd


def test_an_empty_groups_weight_gradient_is_zero_whatever_the_kernel_returns(monkeypatch):
    """torch's grouped kernel on Blackwell (SM 100) returns non-zero weight gradients for groups without
    rows (pytorch#172439): stand such a kernel in, and the experts that got no tokens still get zeros."""
    real = grouped_mm._grouped_mm

    class _Garbage(torch.autograd.Function):  # the real product; its weight gradient has 7s in empty groups
        @staticmethod
        def forward(ctx, x, w, offs):
            ctx.save_for_backward(x, w, offs)
            return real(x, w, offs=offs)

        @staticmethod
        def backward(ctx, gy):
            x, w, offs = ctx.saved_tensors
            with torch.enable_grad():
                xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
                dx, dw = torch.autograd.grad(real(xs, ws, offs=offs), (xs, ws), gy)
            return dx, dw + 7.0 * (torch.tensor(SIZES) == 0).view(-1, 1, 1), None

    monkeypatch.setattr(grouped_mm, "_grouped_mm", lambda x, w, offs: _Garbage.apply(x, w, offs))
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(sum(SIZES), 16, generator=gen), torch.randn(len(SIZES), 16, 24, generator=gen)
    w.requires_grad_()
    Segments.of(SIZES, x, "grouped").mm(x, w).sum().backward()
    empty = [i for i, n in enumerate(SIZES) if n == 0]
    assert torch.count_nonzero(w.grad[empty]) == 0
    want = torch.stack([x[sum(SIZES[:i]) : sum(SIZES[: i + 1])].sum(0) for i in range(len(SIZES))])
    torch.testing.assert_close(w.grad, want[:, :, None].expand(-1, -1, 24))
