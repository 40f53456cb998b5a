"""The fp8 cast and scale math against references: the scale formula in float64, torch's own fp8
rounding, torch._scaled_mm (its CPU implementation) for the emulated GEMM, and a linear's three GEMMs
written out by hand."""

import pytest
import torch

from parallel.layers import ColumnParallelLinear, Fp8Recipe, enable_fp8
from parallel.layers.fp8 import E4M3, E5M2, cast, fp8_device_problem, quantize, scale_of, scaled_mm


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_scale_maps_amax_to_the_dtype_max():
    x = _x(64, 32)
    for dtype, top in ((E4M3, 448.0), (E5M2, 57344.0)):
        q, inv = quantize(x, dtype, None)
        amax = x.abs().max().double()
        assert inv.item() == pytest.approx((amax / top).item(), rel=1e-7)
        assert q.float().abs().max().item() == top  # the largest element lands on the largest value
    s = scale_of(x.abs().amax(1, keepdim=True), E4M3, power_of_2=True)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5) and torch.all(s * x.abs().amax(1, keepdim=True) <= 448)
    assert torch.isfinite(scale_of(torch.zeros(()), E4M3))  # an all-zero tensor keeps a finite scale


def test_cast_is_torchs_rounding_saturated():
    x = _x(1000)
    s = torch.tensor(37.5)
    ref = (x.double() * 37.5).clamp(-448, 448).float().to(E4M3)  # nearest-even by torch's own conversion
    assert torch.equal(cast(x, s, E4M3).view(torch.uint8), ref.view(torch.uint8))
    big = cast(torch.tensor([1e6, -1e6]), torch.tensor(1.0), E4M3).float()
    assert big.tolist() == [448.0, -448.0]  # saturated, not NaN (e4m3fn has no inf)


@pytest.mark.parametrize("rowwise", [False, True])
def test_emulated_gemm_matches_torch_scaled_mm(rowwise):
    a, b = _x(32, 64, seed=1), _x(48, 64, seed=2)
    dim = 1 if rowwise else None
    qa, sa = quantize(a, E4M3, dim, power_of_2=rowwise)
    qb, sb = quantize(b, E4M3, dim, power_of_2=rowwise)
    sb = sb.t().contiguous() if rowwise else sb
    ours = scaled_mm(qa, sa, qb.t(), sb, torch.float32, emulate=True)
    torchs = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert (ours - torchs).norm() / torchs.norm() < 1e-6  # the summation order only
    assert (ours - a @ b.t()).norm() / (a @ b.t()).norm() < 0.1  # and it is a GEMM of a and b


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_linear_gemms_written_out(scaling):
    """y, dX, dW of a column layer = the dequantised operands' products, cast as the recipe says."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(32, 48, bias=False)
    enable_fp8([layer], Fp8Recipe(scaling, emulate=True))
    x = _x(16, 32, seed=3).requires_grad_()
    dy = _x(16, 48, seed=4)
    y = layer(x)
    y.backward(dy)
    w, rw = layer.weight.detach(), scaling == "rowwise"

    def dq(t, dtype, dim):
        q, inv = quantize(t, dtype, dim, power_of_2=rw)
        return q.float() * inv

    g = E4M3 if rw else E5M2
    r = (lambda d: d) if rw else (lambda d: None)
    assert torch.allclose(y, dq(x.detach(), E4M3, r(1)) @ dq(w, E4M3, r(1)).t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, dq(dy, g, r(1)) @ dq(w, E4M3, r(0)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.weight.grad, dq(dy, g, r(0)).t() @ dq(x.detach(), E4M3, r(0)), rtol=1e-5, atol=1e-5)


def test_device_without_fp8_kernels_is_named():
    assert "without fp8 GEMM kernels" in fp8_device_problem("cpu", emulate=False)
    assert fp8_device_problem("cpu", emulate=True) is None
