"""The planner's MoE figures against the real trainer: one dry-run rank (``mode=dryrun``, the trainer on
meta tensors, balanced routing) of mixtral_tiny at dp=4, ep=2 — model states to the byte, every group's
bytes (the ep all-to-alls, the experts' gradients on edp, the dense ones on dp) as the byte counter saw."""

from recipes.tools import dryrun
from recipes.tools.plan import plan_from_config

from .test_dryrun import recipe


def test_moe_dry_run_equals_the_plan(tmp_path):
    rc = recipe(
        "gpt_tiny",
        [
            "model.preset=mixtral_tiny",
            "parallel.dp=4",
            "parallel.ep=2",
            "parallel.zero=1",
            "train.global_batch=16",
            "train.micro_batch=2",
        ],
    )
    rc.data.source, rc.data.path = "embedded", None
    result = dryrun.run_ranks(rc, [0], 4, str(tmp_path), jobs=1, timeout_s=180)[0]
    plan = plan_from_config(rc)
    cmp = dryrun.compare_with_plan(result, plan)
    sent, planned = cmp["bytes"]["dryrun"], cmp["bytes"]["plan"]
    assert sent["ep"] > 0 and sent["edp"] > 0 and sent["dp"] > 0
    assert {g: round(b) for g, b in sent.items()} == {g: round(planned[g]) for g in sent}
    assert all(planned[g] == 0 for g in set(planned) - set(sent))
    mem, pm = cmp["memory"]["dryrun"], cmp["memory"]["plan"]
    assert [mem[k] for k in ("params", "grads", "optimizer")] == [pm[k] for k in ("params", "grads", "optimizer")]
    assert 0.85 <= mem["total"] / pm["total"] <= 1.15, (mem, pm)
