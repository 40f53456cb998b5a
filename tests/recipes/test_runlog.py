"""Rank-0 logging: metrics.jsonl always, wandb offline with no network, LR schedule."""

import json

import pytest

from recipes.runlog import RunLogger, lr_at


def test_metrics_file_and_silent_other_ranks(tmp_path):
    log = RunLogger(tmp_path / "r0", enabled=True, total_steps=2, progress=True)
    log.log({"step": 1, "loss": 5.0, "lr": 1e-3})
    log.advance()
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "r0" / "metrics.jsonl")]
    assert rows == [{"step": 1, "loss": 5.0, "lr": 1e-3}]
    quiet = RunLogger(tmp_path / "r1", enabled=False, total_steps=2)
    quiet.log({"step": 1})
    quiet.close()
    assert not (tmp_path / "r1").exists()


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(tmp_path, enabled=True, total_steps=1, progress=False, wandb_mode="offline",
                    config={"model": {"preset": "gpt_tiny"}})
    log.log({"step": 1, "loss": 4.0})
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_lr_schedule_warms_up_then_decays():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(110, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_at(100, schedule="constant", **kw) == 1.0
