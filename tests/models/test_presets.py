"""The named sizes have the published parameter counts (built on the meta device: no memory)."""

import pytest

from models import build_model
from models.config import preset


@pytest.mark.parametrize(
    "name,published",
    [
        ("llama3_8b", 8.03e9),
        ("llama3_70b", 70.55e9),
        ("qwen3_8b", 8.19e9),
        ("llama_7b", 6.74e9),
        ("qwen3_30b_a3b", 30.53e9),
        ("gpt2", 124e6),
    ],
)
def test_parameter_counts_are_the_published_ones(name, published):
    model = build_model(preset(name).validate(), device="meta")
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(published, rel=0.005), params
