"""logger.profile: a Chrome/Perfetto trace per rank with the schedule's actions and the collectives named."""

import json

import pytest

from parallel.testing import run_ranks
from recipes.config import ConfigError, validate
from recipes.training.profiling import trace_path

from .test_train_e2e import _train, tiny_recipe


def test_profiled_steps_write_one_trace_per_rank_with_named_actions_and_collectives(tmp_path):
    rc = tiny_recipe(pp=2, tp=2, parallel__pp_schedule="1f1b", logger__profile=[2, 3], train__max_steps=3)
    run_ranks(_train, 4, rc, str(tmp_path), timeout=300)
    for rank in range(4):
        trace = json.loads(trace_path(tmp_path, rank).read_text())  # Chrome trace JSON: what Perfetto opens
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"train_step 2", "train_step 3"} <= names and "train_step 1" not in names
        for prefix in (
            "Forward(mb=0, chunk=0)",
            "Backward(mb=3, chunk=0)",
            "comm.p2p[pp]",
            "comm.broadcast[pp]",
            "comm.all_reduce[tp]",
        ):
            assert any(n.startswith(prefix) for n in names), (rank, prefix)
        stage = rank // 2  # tp fastest: ranks 0,1 are stage 0
        sent = "SendActivation" if stage == 0 else "SendGrad"
        assert any(sent in n for n in names), (rank, sent)


@pytest.mark.parametrize("bad", [[0, 1], [3, 2], [1, 99], [2]])
def test_malformed_profile_ranges_are_refused(bad):
    rc = tiny_recipe(logger__profile=bad)
    with pytest.raises(ConfigError, match="logger.profile"):
        validate(rc, world_size=1)
