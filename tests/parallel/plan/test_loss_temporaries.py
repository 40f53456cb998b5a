"""The loss's transient memory on the last stage, measured on the real cross-entropy: every tensor
the step creates is counted while alive (a dispatch mode), the peak above what the forward stores."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel.groups import build_groups
from parallel.layers import vocab_parallel_cross_entropy
from parallel.plan import ModelShape
from parallel.plan.memory import loss_temporary_bytes
from parallel.testing import run_ranks
from parallel.topology import Topology

B, D = 2, 4  # a narrow head: its weight and input gradients are < 3 % of the logits


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode while any tensor on them is alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}  # storage address -> tensors on it still alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if ptr not in self._refs:
                    if n == 0 or any(
                        isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                        for a in tree_flatten((args, kwargs))[0]
                    ):
                        continue  # a view or an in-place result of an input made outside the mode
                    self._refs[ptr] = 0
                    self.live += n
                    self.peak = max(self.peak, self.live)
                self._refs[ptr] += 1
                weakref.finalize(t, self._free, ptr, n)
        return out

    def _free(self, ptr: int, n: int) -> None:
        self._refs[ptr] -= 1
        if not self._refs[ptr]:
            del self._refs[ptr]
            self.live -= n


def _measure(shape: ModelShape, tp: int, dtype: torch.dtype) -> float:
    group = build_groups(Topology(1, 1, tp)).tp if tp > 1 else None
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(B, shape.seq_len, D, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(shape.padded_vocab(tp) // tp, D, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, shape.vocab_size, (B, shape.seq_len), generator=gen)
    meter = LiveBytes()
    with meter:  # the logits are a temporary, as in model.loss(model(ids), ids)
        loss = vocab_parallel_cross_entropy(h @ w.t(), targets, group, vocab_size=shape.vocab_size).mean()
        stored = meter.live
        loss.backward()
    return meter.peak - stored


def _shape(vocab: int) -> ModelShape:
    return ModelShape("gpt", 1, D, 1, 1, 4 * D, vocab, 64, vocab_multiple=8)


@pytest.mark.parametrize("vocab", [1000, 996])  # padded to 1,000 (tp 1) / 1,008 (tp 2) or not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_temporaries_one_rank(vocab, dtype):
    shape, precision = _shape(vocab), "fp32" if dtype == torch.float32 else "bf16"
    assert _measure(shape, 1, dtype) == pytest.approx(
        loss_temporary_bytes(shape, B, tp=1, precision=precision), rel=0.05
    )


def _both(vocab):
    return [_measure(_shape(vocab), 2, dt) for dt in (torch.float32, torch.bfloat16)]


def test_loss_temporaries_vocabulary_parallel():
    for vocab in (1008, 1000):
        for measured in run_ranks(_both, 2, vocab, timeout=60):
            for got, precision in zip(measured, ("fp32", "bf16")):
                want = loss_temporary_bytes(_shape(vocab), B, tp=2, precision=precision)
                assert got == pytest.approx(want, rel=0.05), (vocab, precision)
