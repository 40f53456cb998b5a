"""The planner's training FLOPs per token (``parallel.plan.moe.flops_per_token``, MLA's attention core
included) against torch's FLOP counter on one forward + backward of the tiny models.

    PYTHONPATH=$PWD python benchmarks/deepseek_flops.py
"""

import torch
from torch.utils.flop_counter import FlopCounterMode

from models.config import preset
from models.transformer import build_model
from parallel.plan.moe import flops_per_token
from parallel.plan.shape import model_flops_per_token


def main() -> None:
    cases = [("deepseek_tiny", {}), ("deepseek_tiny", {"q_lora_rank": 0}), ("qwen3_tiny", {}), ("mixtral_tiny", {})]
    print(f"{'model':<32} {'counted':>12} {'planned':>12} {'ratio':>7}")
    for name, changes in cases:
        cfg = preset(name, seq_len=16, **changes)
        model = build_model(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            model.loss(model(ids), ids).backward()
        counted = counter.get_total_flops() / ids.numel()
        planned = flops_per_token(cfg) if cfg.moe_experts else model_flops_per_token(cfg)
        label = name + "".join(f" {k}={v}" for k, v in changes.items())
        print(f"{label:<32} {counted:>12.0f} {planned:>12.0f} {planned / counted:>7.3f}")


if __name__ == "__main__":
    main()
