"""The plan benchmark's breakdown (``python -m benchmarks.plan --breakdown``): a layout's step split
into its measured parts on the host, beside the planner's parts of the same layout."""

from __future__ import annotations

import re
import time
from pathlib import Path

from .plan import TRAIN, _config, _disturbance


def _timed(fn, into: list[float]):
    """``fn`` that appends each call's host seconds to ``into`` (a timing hook on one instance)."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def _breakdown_worker(rc, run_dir: str, steps: int, skip: int) -> dict:
    """One spawned rank: train ``steps`` steps of ``rc`` with the recipe's :class:`~recipes.training.trainer.Trainer`
    and, on the steps after the first ``skip``, time the step's parts on the host: the executor's run
    (forwards, backwards, pipeline transfers, the collectives issued and waited inside them), the ZeRO step
    (reductions at the step, clipping's norm, the optimizer, the after-step gathers), the rest (the
    loss's broadcast and all-reduce, the loop); and inside them the time blocked in each collective kind
    (``parallel.comm``'s counter: a blocking call's duration, an asynchronous handle's ``wait()``) per
    group and operation, with its call count; and this process's wait for a CPU (``runqueue_s``).
    Returns the medians over the timed steps of every figure (:func:`recipes.training.reports.measured_parts`)."""
    from parallel import comm
    from recipes.training.reports import measured_parts, runqueue_seconds
    from recipes.training.trainer import Trainer

    trainer = Trainer(rc, run_dir)
    engine = trainer.engine
    run_s: list[float] = []
    opt_s: list[float] = []
    executor_run = engine.executor.run
    run_counter = comm.CommCounter()  # the run's own waits: the loss's reduction comes after it

    def counted_run(*args, **kwargs):
        with run_counter:
            return executor_run(*args, **kwargs)

    engine.executor.run = _timed(counted_run, run_s)
    zero_step = engine.zero.step
    opt_counter = comm.CommCounter()

    def counted_step(*args, **kwargs):
        with opt_counter:
            return zero_step(*args, **kwargs)

    engine.zero.step = _timed(counted_step, opt_s)
    samples = []
    for step in range(steps):
        run_s.clear(), opt_s.clear(), opt_counter.reset(), run_counter.reset()
        rq0, t0 = runqueue_seconds(), time.perf_counter()
        trainer.train_step(step, read=True)
        wall, rq = time.perf_counter() - t0, runqueue_seconds() - rq0
        if step >= skip:
            samples.append(
                dict(
                    step_s=wall,
                    runqueue_s=rq,
                    run_s=sum(run_s),
                    optimizer_step_s=sum(opt_s),
                    comm=engine.last_comm.summary(),
                    comm_in_optimizer_step=opt_counter.summary(),
                    comm_in_run=run_counter.summary(),
                )
            )
    comm.barrier()
    return measured_parts(samples)


def breakdown(name: str, args: list[str], hw: Path, out: Path, steps: int = 16, skip: int = 2) -> dict:
    """The measured parts of one layout's step (:func:`_breakdown_worker`, rank 0's, and every
    rank's step time) beside the planner's parts of the same layout (:func:`recipes.training.reports.predicted_parts`)."""
    from launch.local import spawn_local
    from recipes.tools.plan import plan_from_config
    from recipes.training.reports import predicted_parts
    from recipes.validation import validate

    rc = _config([*TRAIN, *args, f"plan.hardware={hw}", f"train.max_steps={steps}"])

    layout = validate(rc, world_size=None)
    run_dir = out / ("breakdown_" + re.sub(r"\W+", "_", name))
    run_dir.mkdir(parents=True, exist_ok=True)
    per_rank, other = _disturbance(
        lambda: spawn_local(_breakdown_worker, layout.world_size, rc, str(run_dir), steps, skip)
    )
    plan = plan_from_config(rc)
    last = (rc.parallel.pp - 1) * layout.world_size // rc.parallel.pp  # the last stage's first rank
    return {
        "layout": name,
        "measured": per_rank[0],
        "predicted": predicted_parts(plan),
        "last_stage": None if last == 0 else {"measured": per_rank[last], "predicted": predicted_parts(plan, -1)},
        "measured_step_s_per_rank": [per_rank[r]["step_s"] for r in sorted(per_rank)],
        "other_cores": other,
    }


def format_layout_breakdown(part: dict) -> str:
    """:func:`recipes.training.reports.format_breakdown` of rank 0 and, with pp > 1, of the last stage."""
    from recipes.training.reports import format_breakdown

    other = f" (other jobs {part['other_cores']:.2f} cores)" if "other_cores" in part else ""
    text = format_breakdown(f"{part['layout']}, rank 0{other}", part["measured"], part["predicted"])
    if part.get("last_stage"):
        last = part["last_stage"]
        text += "\n" + format_breakdown(f"{part['layout']}, last stage", last["measured"], last["predicted"])
    return text
