"""Suite-wide settings, applied before any test module is imported."""

import os

# torch.cuda.is_available() / device_count() ask NVML instead of initialising the CUDA driver in the pytest
# process: a process that initialised CUDA cannot fork children that use it, and parallel.testing.run_ranks forks
# (on a GPU machine every device test would fail with "CUDA error: initialization error"). PyTorch documents this
# variable for exactly that purpose.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
