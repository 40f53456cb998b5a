"""The experts' grouped matmuls (parallel/layers/grouped_mm.py): every way equals the loop, forward and
backward (fp32, uneven segments with empty ones), with and without biases; unaligned operands fall back;
the way is chosen once per device type."""

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
    assert expert_matmul_kind("meta") == "loop"
