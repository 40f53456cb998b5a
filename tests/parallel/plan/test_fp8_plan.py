"""The planner's fp8: peak FLOP/s per profile, the GEMMs' time, and the activations a block saves
(measured with autograd's saved tensors against the formula)."""

import pytest
import torch

from models.config import preset
from parallel.plan import hardware_profile
from parallel.plan.compute import FP8_CAST_BYTES, fp8_cast_elements, layer_time
from parallel.plan.memory import layer_activation_bytes
from parallel.plan.shape import ModelShape
from parallel.testing import run_ranks
from tests.recipes.test_plan_vs_run import _saved_per_layer


def test_fp8_peaks_are_twice_bf16_where_there_are_kernels():
    for name in ("h100", "h200", "h100_pcie"):
        hw = hardware_profile(name)
        assert hw.peak_flops("fp8") == 2 * hw.peak_flops("bf16")
    a100 = hardware_profile("a100")  # no fp8 tensor cores: emulation multiplies in fp32
    assert a100.peak_tflops_8 == 0 and a100.peak_flops("fp8") == a100.peak_flops("fp32")
    assert hardware_profile("h100").time_scaled(2.0).peak_flops("fp8") == hardware_profile("h100").peak_flops("fp8") / 2


def test_fp8_block_time_halves_its_large_gemms_and_pays_the_casts():
    shape, hw = ModelShape.of(preset("llama_7b")), hardware_profile("h100")
    bf16 = layer_time(shape, 1, 1, False, hw, "bf16")
    fp8 = layer_time(shape, 1, 1, False, hw, "bf16", fp8="tensorwise")
    assert fp8.gemm / bf16.gemm == pytest.approx(0.5)  # half the FLOP time, and half the operand bytes
    casts = FP8_CAST_BYTES * fp8_cast_elements(shape, shape.seq_len, 1) / hw.hbm_bytes_per_s
    assert fp8.elementwise - bf16.elementwise == pytest.approx(casts)
    assert fp8.attention == bf16.attention


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_fp8_saved_activations_are_the_planners(name):
    """Tensorwise saves the linears' inputs as their fp8 copies (plus a 4-byte scale each: at most 4 a
    block, left out of the formula); rowwise saves what bf16 saves."""
    runs = [(name, 1, recipe, torch.bfloat16) for recipe in (None, "tensorwise", "rowwise")]
    (bf16, cfg), *fp8 = [run_ranks(_saved_per_layer, 1, *args, timeout=120)[0] for args in runs]
    kw = dict(checkpointing="selective", precision="bf16")
    for recipe, (measured, _) in zip(("tensorwise", "rowwise"), fp8):
        planned = layer_activation_bytes(cfg, 2, fp8=recipe, **kw) - layer_activation_bytes(cfg, 2, **kw)
        assert 0 <= measured - bf16 - planned <= 4 * 4, (recipe, measured - bf16, planned)
    assert planned == 0  # rowwise
