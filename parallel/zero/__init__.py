"""ZeRO-sharded data parallelism (stages 0–3), mixed precision, loss scaling,
gradient clipping and top-k gradient compression, over any ``nn.Module`` and
one data-parallel process group. See ``docs/zero.md``.
"""

from .compression import TopKCompressor, topk_count, topk_sent_bytes
from .config import ZeroConfig
from .engine import ZeroDataParallel
from .layout import BucketLayout, ParamSlot, ZeroConfigError, plan_buckets
from .scaler import DynamicLossScaler
from .theory import model_state_bytes, step_sent_bytes

__all__ = [
    "BucketLayout",
    "DynamicLossScaler",
    "ParamSlot",
    "TopKCompressor",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroDataParallel",
    "model_state_bytes",
    "plan_buckets",
    "step_sent_bytes",
    "topk_count",
    "topk_sent_bytes",
]
