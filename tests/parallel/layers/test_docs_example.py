"""The custom block of docs/tp.md runs at tp=2 (and with sequence parallelism) as at tp=1."""

import pathlib
import re

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.layers import gather_full_tensor, init_parameters_, reduce_sequence_parallel_grads
from parallel.testing import run_ranks

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "tp.md"


def _my_block_class():
    code = re.search(r"```python\n(.*?class MyBlock.*?)```", DOC.read_text(), re.S).group(1)
    namespace = {}
    exec(code, namespace)  # noqa: S102 - our own documentation
    return namespace["MyBlock"]


def _run(group, sp):
    block = init_parameters_(_my_block_class()(32, 4, tp_group=group, sequence_parallel=sp), seed=1, tp_group=group)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    if sp:
        x = comm.split_along(x, 1, group)
    y = block(x)
    y.square().sum().backward()  # a per-rank sum: with SP each rank's tokens are its own
    reduce_sequence_parallel_grads(block, group)
    y = comm.all_gather_along(y.detach(), 1, group) if sp else y.detach()
    return y, {n: gather_full_tensor(p, group, data=p.grad) for n, p in block.named_parameters()}


def _rank(sp):
    return _run(dist.new_group([0, 1], group_desc="tp"), sp)


@pytest.mark.parametrize("sp", [False, True])
def test_doc_block_matches_single_process(sp):
    ref_y, ref_grads = _run(None, False)
    y, grads = run_ranks(_rank, 2, sp)[0]
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=name)
