"""logger.timeline's step trains as the loop decided (read or not), so time_report compares like with like."""

import contextlib
from types import SimpleNamespace

import pytest

from recipes.training import reports


@pytest.mark.parametrize("read", [False, True])
def test_timeline_step_passes_the_loops_read(monkeypatch, read):
    seen = []
    monkeypatch.setattr(reports.comm, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(reports, "gather_timeline", lambda *a: [])
    monkeypatch.setattr(reports, "bubble_fraction", lambda t: 0.0)
    engine = SimpleNamespace(recording_timeline=contextlib.nullcontext, timeline=None)
    trainer = SimpleNamespace(
        rank=1, engine=engine, topology=None, device=None, train_step=lambda step, read=True: seen.append(read) or {}
    )
    assert reports.timeline_step(trainer, 3, "unused.png", read=read) == {"bubble": 0.0}
    assert seen == [read]
