import torch
from torch import nn

from parallel.memory import SavedActivationMeter, peak_memory_bytes


def test_meter_counts_saved_activations_not_parameters():
    lin = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    meter = SavedActivationMeter(lin.parameters())
    with meter:
        y = torch.tanh(lin(x))  # linear saves x (and the weight); tanh saves its output
    assert meter.bytes == x.nbytes + y.nbytes
    y.sum().backward()
    with SavedActivationMeter(lin.parameters()) as m2:
        pass
    assert m2.bytes == 0


def test_peak_memory_is_positive_on_cpu():
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20


def _micro_batches(n, meter_cls=SavedActivationMeter):
    """n micro-batches, each freed by its backward before the next: the allocator reuses addresses."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    meter = meter_cls(mlp.parameters())
    with meter:
        for _ in range(n):
            mlp(torch.randn(8, 64)).square().sum().backward()
    return meter.bytes


def test_every_micro_batch_is_counted_even_where_addresses_are_reused():
    one = _micro_batches(1)
    assert one > 0
    assert [_micro_batches(4) for _ in range(5)] == [4 * one] * 5


def test_a_storage_saved_twice_while_alive_counts_once():
    x = torch.randn(32, 32, requires_grad=True)
    with SavedActivationMeter([]) as m:
        h = x * 2
        prod = h * h.t()  # saves h and its view h.t(): one storage
        y = prod @ h[:, :16]  # saves prod and another view of h
    assert m.bytes == h.nbytes + prod.nbytes
    assert y.requires_grad
