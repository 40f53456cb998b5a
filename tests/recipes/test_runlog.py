"""Rank-0 logging: metrics.jsonl always, wandb offline with no network, LR schedule."""

import json
import re

import pytest

from recipes.training.runlog import RunLogger, lr_at


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
    log = RunLogger(
        tmp_path,
        enabled=True,
        total_steps=1,
        progress=False,
        wandb_mode="offline",
        config={"model": {"preset": "gpt_tiny"}},
    )
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


def _refused(address, timeout):
    raise TimeoutError(f"timed out connecting to {address[0]}")


class _Conn:
    def close(self):
        pass


def test_wandb_online_check_names_what_is_missing(tmp_path):
    from recipes.training.runlog import wandb_online_problem

    no_netrc = {"NETRC": str(tmp_path / "absent")}
    assert "no API key" in wandb_online_problem(no_netrc, connect=lambda *a, **k: _Conn())
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password abc123\n")
    seen = []
    key = {"NETRC": str(tmp_path / "netrc")}
    assert wandb_online_problem(key, connect=lambda a, timeout: seen.append((a, timeout)) or _Conn()) is None
    assert seen == [(("api.wandb.ai", 443), 3.0)]
    problem = wandb_online_problem({"WANDB_API_KEY": "k", "WANDB_BASE_URL": "http://wb.local:8080"}, connect=_refused)
    assert problem.startswith("wb.local:8080 is not reachable within 3 s")


def test_wandb_online_without_network_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    from recipes.training import runlog

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setattr(runlog.socket, "create_connection", _refused)
    log = RunLogger(tmp_path, enabled=True, total_steps=1, progress=False, wandb_mode="online")
    log.log({"step": 1, "loss": 4.0})
    log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "not reachable" in warnings[0] and "wandb sync" in warnings[0]
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_fit_metrics_keeps_the_first_that_fit():
    from recipes.training.runlog import fit_metrics

    shown = {"loss": "2.31", "lr": "0.0003", "tokens_per_s": "1.2e+03"}
    assert fit_metrics(shown, 100) == "loss=2.31, lr=0.0003, tokens_per_s=1.2e+03"
    assert fit_metrics(shown, 20) == "loss=2.31, lr=0.0003"
    assert fit_metrics(shown, 5) == ""


RECORD = {
    "step": 7,
    "loss": 2.3456,
    "val_loss": 2.4,
    "lr": 3e-4,
    "grad_norm": 1.234,
    "tokens_per_s": 12345.6,
    "mfu": 0.0123,
    "comm_frac": 0.456,
    "mem_gb": 1.23,
}


def _on_a_pty(tmp_path, monkeypatch, columns):
    """Run a logger whose stderr is a pseudo-terminal ``columns`` wide (0: size unset); return its screen lines."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr("sys.stderr", tty)
        log = RunLogger(tmp_path, enabled=True, total_steps=300, progress=True)
        for step in (1, 2, 3):
            log.log(dict(RECORD, step=step))
            log.advance()
        if log._bar is not None:
            log._bar.refresh()
        log.close()
    screen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    return [line for part in screen.decode().split("\n") for line in part.split("\r") if line.strip()]


@pytest.mark.parametrize("columns", [80, 120])
def test_progress_line_fits_the_terminal_with_its_bar_and_whole_metrics(tmp_path, monkeypatch, columns):
    lines = _on_a_pty(tmp_path, monkeypatch, columns)
    assert lines and all(len(line) <= columns for line in lines), [len(x) for x in lines]
    last = [line for line in lines if "3/300" in line][-1]
    assert re.search(r"\|[ ▏▎▍▌▋▊▉█]{10,}\|", last), last  # the bar itself is still there, 10+ columns
    assert last.rstrip().endswith("]") and "loss=2.35" in last, last  # no metric cut in half


def test_a_terminal_of_unknown_width_gets_one_line_per_logged_step(tmp_path, monkeypatch, capsys):
    _on_a_pty(tmp_path, monkeypatch, 0)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["step 1", "step 2", "step 3"] and "loss=2.35" in out[0]


def test_without_a_terminal_every_logged_step_prints_a_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    log = RunLogger(tmp_path, enabled=True, total_steps=300, progress=True)  # stderr captured: not a tty
    for step in (1, 2):
        log.log(dict(RECORD, step=step))
        log.advance()
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["step 1", "step 2"] and "loss=2.35" in out[0]
