"""A Trainer that is no longer referenced is freed, with its model and buffers (a GPU's memory comes back).

Found on an H200: ``benchmarks.gpu_mfu`` measured three layouts in one process and each one's peak memory
held every earlier trainer's 20 GB of model states, because a tensor hook (kept by the tensor's C++ side,
where Python's garbage collector cannot look) held the ZeRO engine."""

import gc
import weakref

from parallel.testing import run_ranks

from .test_train_e2e import tiny_recipe

VARIANTS = {
    "bf16 ZeRO-1": dict(train__precision="bf16"),
    "fp32 ZeRO-1 (no hooks at dp=1)": {},
    "bf16 ZeRO-3": dict(parallel__zero=3, train__precision="bf16"),
    "ZeRO-3 unsharded accumulation": dict(parallel__zero=3, parallel__zero_accumulate="unsharded"),
    "offload": dict(parallel__zero=1, parallel__offload="optimizer"),
    "MoE": dict(model__moe_experts=4, model__moe_top_k=2),
}


def _alive_after_delete() -> dict[str, list[str]]:
    from recipes.training.trainer import Trainer

    alive = {}
    for name, overrides in VARIANTS.items():
        trainer = Trainer(tiny_recipe(train__max_steps=2, **overrides), run_dir=".")
        for step in range(2):
            trainer.train_step(step)
        param = next(iter(trainer.engine.zero._param_bucket))  # outlives the engine, like a model wrapped again
        refs = {
            "trainer": weakref.ref(trainer),
            "engine": weakref.ref(trainer.engine),
            "model": weakref.ref(trainer.engine.model),
            "zero": weakref.ref(trainer.engine.zero),
        }
        del trainer
        gc.collect()
        alive[name] = [what for what, ref in refs.items() if ref() is not None]
        if getattr(param, "_post_accumulate_grad_hooks", None):  # the dead engine's hooks went with it
            alive[name].append("hooks on a parameter")
    return alive


def test_a_deleted_trainer_is_freed():
    alive = run_ranks(_alive_after_delete, 1, timeout=120)[0]
    assert alive == {name: [] for name in VARIANTS}
