"""Suite-wide settings, applied before any test module is imported."""

import os

# torch.cuda.is_available() / device_count() ask NVML instead of initialising the CUDA driver in the pytest
# process: a process that initialised CUDA cannot fork children that use it, and parallel.testing.run_ranks forks
# (on a GPU machine every device test would fail with "CUDA error: initialization error"). PyTorch documents this
# variable for exactly that purpose.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def pytest_configure(config):
    """On a GPU machine, hide the GPUs from every run but the device tests' (``-m cuda``): the suite's ranks are
    forked gloo processes, and on a CUDA build a backward in the pytest process starts autograd's device threads,
    after which every forked child fails ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). ``benchmarks/gpu_check.sh`` runs ``-m cuda``, whose tests run no autograd in this process."""
    if "cuda" not in (config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
