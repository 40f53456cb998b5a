"""Layers are initialised when built: torch.nn's distributions, the same full tensor for every tp,
nothing drawn or allocated on ``meta``; README's snippet runs as printed and equals plain PyTorch."""

import pathlib
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelMLP,
    ParallelSelfAttention,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_tensor,
)
from parallel.testing import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _layers(group):
    torch.manual_seed(3)
    return {
        "col": ColumnParallelLinear(16, 32, tp_group=group),
        "row": RowParallelLinear(32, 16, tp_group=group),
        "emb": VocabParallelEmbedding(64, 16, vocab_size=60, tp_group=group),
    }


def _full_weights(group=None):
    return {
        f"{k}.{n}": gather_full_tensor(p, group) for k, m in _layers(group).items() for n, p in m.named_parameters()
    }


def _tp2_weights():
    return _full_weights(dist.new_group([0, 1], group_desc="tp"))


def test_construction_initialises_with_torch_distributions_the_same_for_every_tp():
    ref = _full_weights()
    for name, w in run_ranks(_tp2_weights, 2)[0].items():
        torch.testing.assert_close(w, ref[name], atol=0, rtol=0, msg=name)
    bound = 1 / 16**0.5  # nn.Linear: U(±1/sqrt(in_features)), in = the global 16 for col, 32 for row
    for name, b in (("col.weight", bound), ("col.bias", bound), ("row.weight", 32**-0.5), ("row.bias", 32**-0.5)):
        w = ref[name]
        assert torch.isfinite(w).all() and w.abs().max() <= b and w.abs().max() > 0.8 * b, name
        assert abs(w.std().item() - b / 3**0.5) < 0.25 * b, name
    emb = ref["emb.weight"]  # nn.Embedding: N(0, 1); vocabulary padding (rows >= 60) is cut off by the gather
    assert emb.shape == (60, 16) and 0.8 < emb.std().item() < 1.2
    assert not torch.equal(ref["col.weight"][:8], ref["col.weight"][8:16]), "rows must not repeat"
    torch.manual_seed(3)
    again = ColumnParallelLinear(16, 32)
    other = ColumnParallelLinear(16, 32)
    assert torch.equal(again.weight, ref["col.weight"]) and not torch.equal(again.weight, other.weight)


def test_meta_construction_draws_and_allocates_nothing():
    state = torch.get_rng_state()
    big = [
        ColumnParallelLinear(12288, 4 * 12288, device="meta"),
        RowParallelLinear(4 * 12288, 12288, device="meta"),
        VocabParallelEmbedding(50304, 12288, device="meta"),
        ParallelMLP(12288, 49152, device="meta"),
        ParallelSelfAttention(12288, 96, device="meta"),
        LayerNorm(12288, device="meta"),
        RMSNorm(12288, device="meta"),
    ]
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.is_meta for m in big for p in m.parameters())


def _snippets(text):
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def _readme_rank():
    """The README's job-setup snippet, then its parallel.layers snippet, exec'd as printed."""
    code = [s for s in _snippets((ROOT / "README.md").read_text()) if "init_distributed" in s or "parallel.layers" in s]
    ns = {}
    for snippet in code:
        exec(snippet, ns)  # noqa: S102 - our own documentation
    up, down, tp = ns["up"], ns["down"], ns["groups"].tp
    return ns["x"], ns["y"].detach(), [gather_full_tensor(p, tp) for p in (up.weight, up.bias, down.weight, down.bias)]


def test_readme_layers_snippet_runs_as_printed_and_equals_plain_pytorch():
    layer_snippets = [s for s in _snippets((ROOT / "README.md").read_text()) if "from parallel.layers" in s]
    assert layer_snippets, "the README shows no parallel.layers snippet"
    for x, y, (w1, b1, w2, b2) in run_ranks(_readme_rank, 4, timeout=120):
        up, down = torch.nn.Linear(*w1.shape[::-1]), torch.nn.Linear(*w2.shape[::-1])
        with torch.no_grad():
            up.weight.copy_(w1), up.bias.copy_(b1), down.weight.copy_(w2), down.bias.copy_(b2)
        ref = down(F.relu(up(x))).detach()
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_docs_block_is_usable_without_an_explicit_init():
    code = next(s for s in _snippets((ROOT / "docs" / "tp.md").read_text()) if "class MyBlock" in s)
    ns = {}
    exec(code, ns)  # noqa: S102 - our own documentation
    torch.manual_seed(0)
    y = ns["MyBlock"](32, 4)(torch.randn(2, 8, 32))
    assert torch.isfinite(y).all() and y.abs().max() < 1e3
