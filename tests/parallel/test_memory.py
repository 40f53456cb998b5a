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
