"""gridtrain models: GPT (GPT-2/3 style) and Llama built from ``parallel.layers``.

``build_model(cfg, tp_group=..., layers=..., has_embedding=..., has_head=...)`` returns
one pipeline stage; :mod:`models.hf` maps Hugging Face weights onto any layout.
"""

from .config import PRESETS, ModelConfig, ModelConfigError, preset
from .transformer import TransformerBlock, TransformerStage, build_model, gather_full_state_dict, init_rule

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelConfigError",
    "TransformerBlock",
    "TransformerStage",
    "build_model",
    "gather_full_state_dict",
    "init_rule",
    "preset",
]
