"""Pay torch.optim's first-use cost (it imports torch._dynamo, ≈1.5 s) once in the
parent, so that the ranks run_ranks forks inherit it instead of each paying it."""

import torch

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
