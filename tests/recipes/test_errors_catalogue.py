"""The error catalogue: bad inputs a first-time user tries, each through the real CLI entry.

For every entry: exit code 2, the key named in the last line of stderr (which starts with
``error:``), no "Traceback" anywhere in the output, no worker started and no process left
behind. Most entries run in one worker subprocess that calls the recipe's Hydra entry
(``recipes.main.run_recipe``) in a loop, with ``sys.argv`` set per entry and ``spawn_local``
replaced by a trap (reaching it means the input was accepted); a few run as true
``python -m recipes.gpt_tiny`` subprocesses, each in its own session, checked for survivors.

The cases are in ``errors_catalogue_cases.py``; the table in ``docs/errors.md`` is generated from
them: run with ``GRIDTRAIN_WRITE_ERRORS_DOC=1`` and ``-n 0`` to rewrite it (three tests rewrite parts of the
one page: in one process, not two workers); otherwise the test fails when it is stale.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parallel.params import init_key, vocab_rows
from parallel.testing import procs_with as _procs_with

from .errors_catalogue_cases import CATALOGUE, SUBPROCESS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"

WORKERS = 2  # catalogue worker processes


def _tokens(path: Path, splits: dict, meta: dict) -> str:
    path.mkdir(parents=True)
    for name, arr in splits.items():
        np.asarray(arr).tofile(path / f"{name}.bin")
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def _checkpoint(root: Path) -> Path:
    """A real gridtrain checkpoint of gpt_tiny's weights (what a 1-rank run would save)."""
    from models.config import PRESETS
    from models.transformer import build_model
    from parallel.checkpoint import save_checkpoint

    model = build_model(PRESETS["gpt_tiny"], seed=1)
    state = {}
    for name, p in model.named_parameters():
        rows = vocab_rows(p)
        state["model/" + (init_key(p, name))] = p.detach()[:rows].clone()
    return save_checkpoint(state, root / "checkpoints", 4, meta={})


def _fixtures(tmp: Path) -> dict[str, str]:
    import shutil

    u16 = np.uint16
    ok = np.arange(4000, dtype=u16) % 256
    meta = {"dtype": "uint16", "vocab_size": 256}
    f = {"missing": str(tmp / "no-such-dir"), "empty_dir": str(tmp / "empty")}
    (tmp / "empty").mkdir()
    (tmp / "a_file.txt").write_text("hello\n")
    f["a_file"] = str(tmp / "a_file.txt")
    f["bad_json"] = _tokens(tmp / "bad_json", {"train": ok, "val": ok}, meta)
    (tmp / "bad_json" / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 2')
    f["no_dtype"] = _tokens(tmp / "no_dtype", {"train": ok, "val": ok}, {"vocab_size": 256})
    f["empty_train"] = _tokens(tmp / "empty_train", {"train": ok[:0], "val": ok}, meta)
    f["odd_bytes"] = _tokens(tmp / "odd_bytes", {"train": ok, "val": ok}, meta)
    with open(tmp / "odd_bytes" / "train.bin", "ab") as fh:
        fh.write(b"\0")
    f["short_of_header"] = _tokens(
        tmp / "short_of_header", {"train": ok[:3000], "val": ok}, {**meta, "tokens": {"train": 4000, "val": 4000}}
    )
    f["big_vocab"] = _tokens(tmp / "big_vocab", {"train": ok, "val": ok}, {"dtype": "uint16", "vocab_size": 50257})
    over = ok.copy()
    over[1234] = 300
    f["id_over_vocab"] = _tokens(tmp / "id_over_vocab", {"train": over, "val": ok}, meta)
    f["small_val"] = _tokens(tmp / "small_val", {"train": ok, "val": ok[:100]}, meta)
    f["no_val"] = _tokens(tmp / "no_val", {"train": ok}, meta)
    f["no_index"] = _tokens(tmp / "no_index", {"train": ok, "val": ok}, meta)  # sound, but no document index
    for name, text in {
        "ds_bad": "{ nope",
        "ds_list": "[1, 2]",
        "ds_unknown": '{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}}',
        "ds_auto": '{"train_batch_size": "auto"}',
        "ds_bad_lr": '{"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}}',
    }.items():
        (tmp / f"{name}.json").write_text(text)
        f[name] = str(tmp / f"{name}.json")
    ckpt = _checkpoint(tmp / "run")
    f["ckpt"] = str(ckpt)
    for name in ("flipped", "no_shard", "short_metadata", "bad_manifest"):
        copy = tmp / f"ckpt_{name}" / "step_00000004"
        shutil.copytree(ckpt, copy)
        f[f"ckpt_{name}"] = str(copy)
    shard = next((tmp / "ckpt_flipped" / "step_00000004").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    next((tmp / "ckpt_no_shard" / "step_00000004").glob("__0_*.distcp")).unlink()
    md = tmp / "ckpt_short_metadata" / "step_00000004" / ".metadata"
    md.write_bytes(md.read_bytes()[:100])
    (tmp / "ckpt_bad_manifest" / "step_00000004" / "checkpoint.json").write_text("{ truncated")
    for name, latest in (("run_bad_latest", "step_00000009\n"), ("run_empty_latest", "")):
        (tmp / name / "checkpoints").mkdir(parents=True)
        (tmp / name / "checkpoints" / "latest").write_text(latest)
        f[name] = str(tmp / name)
    return f


def _children(pid: int) -> list[int]:
    return _procs_with(1, pid)


def _session_members(sid: int) -> list[int]:
    return _procs_with(3, sid)


def run_catalogue(cases_json: str, out_json: str) -> None:
    """Worker-process loop: each case through ``recipes.main.run_recipe("gpt_tiny")`` in this
    process (sys.argv and environment set, stdout/stderr captured, SystemExit caught)."""
    import recipes.main as entry

    spawned = []

    def trap(*args, **kwargs):
        spawned.append(True)
        raise RuntimeError("the input was accepted: workers would start")

    entry.spawn_local = trap
    results = []
    for argv, env in json.loads(Path(cases_json).read_text()):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        sys.argv = ["recipes.gpt_tiny", *argv]
        out, err, code = io.StringIO(), io.StringIO(), 0
        spawned.clear()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                entry.run_recipe("gpt_tiny")
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # noqa: BLE001 - recorded as a failure of the case
            code, err = f"raised {type(e).__name__}", io.StringIO(err.getvalue() + f"\nTraceback: {e!r}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results.append(
            {
                "code": code,
                "stdout": out.getvalue(),
                "stderr": err.getvalue(),
                "seconds": time.perf_counter() - t0,
                "spawned": bool(spawned),
                "children": _children(os.getpid()),
            }
        )
    Path(out_json).write_text(json.dumps(results))


def _sanitize(text: str, tmp: Path) -> str:
    from recipes.training.data import cache_dir

    text = text.replace(str(tmp), "<tmp>").replace(str(cache_dir()), "~/.cache/gridtrain")
    text = re.sub(r"0x[0-9a-f]{8}", "0x…", text)
    # a file's recorded size holds the run's paths (DCP's .metadata), so it varies with the temp dir
    return re.sub(r"the manifest says \d+ \(", "the manifest says N (", text)


def _check(case: str, code, stdout: str, stderr: str, key: str) -> str:
    """Assert the catalogue's promises for one case; return its message (the last stderr line)."""
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    assert code == 2, f"{case}: exit {code!r}, stderr tail {stderr[-800:]}"
    assert last.startswith("error: "), f"{case}: last line {last!r}"
    assert key in last, f"{case}: {key!r} not named in {last!r}"
    assert "Traceback" not in stdout + stderr, f"{case}: traceback in the output:\n{stderr[-1500:]}"
    return last


def _table(rows: list[tuple[str, str]]) -> str:
    esc = lambda s: s.replace("|", "\\|")
    head = (
        "# Error catalogue\n\nEvery input below is refused before any worker starts, with one line on stderr "
        "(`error: <key>=<value>: <reason>; <fix>`) and exit code 2; `GRIDTRAIN_DEBUG=1` adds the traceback. "
        "Generated by `tests/recipes/test_errors_catalogue.py` (`GRIDTRAIN_WRITE_ERRORS_DOC=1` rewrites it); "
        "`<tmp>/…` are the test's fixture files, `torchrun rank 1/2` the same input on one rank of a "
        "torchrun job.\n\n"
        f"{len(rows)} inputs.\n\n| input (`python -m recipes.gpt_tiny …`) | message |\n| --- | --- |\n"
    )
    return head + "".join(f"| `{esc(i)}` | {esc(m)} |\n" for i, m in rows)


def generated_part(doc: str) -> tuple[str, str]:
    """``docs/errors.md`` split into the generated catalogue (up to the first ``## `` section) and the
    sections kept by hand after it (the faults during a run, checked by their own tests)."""
    at = doc.find("\n\n## ")
    return (doc, "") if at < 0 else (doc[: at + 1], doc[at + 1 :])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalogue")
    return tmp, _fixtures(tmp)


def _argv(overrides: list[str], files: dict, run_dir: Path) -> list[str]:
    return [o.format(**files) for o in overrides] + [f"hydra.run.dir={run_dir}"]


def test_catalogue_through_the_cli(fixtures):
    tmp, files = fixtures
    assert len(CATALOGUE) >= 60
    cases = [(_argv(ov, files, tmp / "runs" / str(i)), env) for i, (ov, _, env) in enumerate(CATALOGUE)]
    t0 = time.monotonic()
    workers = []
    for w in range(WORKERS):  # interleaved shares, one interpreter each, run side by side
        (tmp / f"cases{w}.json").write_text(json.dumps(cases[w::WORKERS]))
        cmd = [
            sys.executable,
            "-c",
            (
                "import sys; from tests.recipes.test_errors_catalogue import run_catalogue; "
                "run_catalogue(sys.argv[1], sys.argv[2])"
            ),
            str(tmp / f"cases{w}.json"),
            str(tmp / f"results{w}.json"),
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same table on a GPU machine (backend=nccl)
        workers.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    for p in workers:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    shares = [json.loads((tmp / f"results{w}.json").read_text()) for w in range(WORKERS)]
    results = [shares[i % WORKERS][i // WORKERS] for i in range(len(cases))]
    rows = []
    for (overrides, key, env), res in zip(CATALOGUE, results):
        name = " ".join(overrides)
        assert not res["spawned"], f"{name}: accepted (workers would have started)"
        assert not res["children"], f"{name}: child processes left behind: {res['children']}"
        last = _check(name, res["code"], res["stdout"], res["stderr"], key)
        where = "torchrun rank 1/2: " if env else ""
        rows.append((where + name.replace("{", "<").replace("}", ">"), _sanitize(last, tmp)))
    elapsed = time.monotonic() - t0
    text = _table(rows)
    generated, sections = generated_part(DOC.read_text() if DOC.exists() else "")
    if os.environ.get("GRIDTRAIN_WRITE_ERRORS_DOC"):
        DOC.write_text(text + sections)  # the hand-kept sections after the table stay
        generated = text
    assert generated == text, (
        "docs/errors.md is stale: rerun with GRIDTRAIN_WRITE_ERRORS_DOC=1 (and -n 0) and commit it"
    )
    print(f"{len(CATALOGUE)} catalogue entries in {elapsed:.1f} s")


def test_true_subprocesses_exit_2_and_leave_nothing(fixtures):
    tmp, files = fixtures
    procs = []
    for i, (overrides, key) in enumerate(SUBPROCESS):
        cmd = [sys.executable, "-m", "recipes.gpt_tiny", *_argv(overrides, files, tmp / "sub" / str(i))]
        procs.append(
            (
                overrides,
                key,
                subprocess.Popen(
                    cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
                ),
            )
        )
    for overrides, key, p in procs:
        out, err = p.communicate(timeout=180)
        _check(" ".join(overrides), p.returncode, out, err, key)
        assert _session_members(p.pid) == [], f"{overrides}: processes of the run survive it"


def test_a_sweep_with_a_failing_job_prints_its_table_and_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.gpt_tiny", "-m", "optim.lr=-1,0.1", "mode=plan", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "sweep summary:" in proc.stdout
    table = proc.stdout[proc.stdout.index("sweep summary:") :]
    assert re.search(r"optim.lr=-1 .*failed: JobFailed: optim.lr=-1.0: must be > 0", table), table
    assert re.search(r"optim.lr=0.1 .*\| ok", table), table


def test_extension_points_and_hydra_keys_pass_the_key_check():
    from recipes.config import check_keys, check_overrides

    check_overrides(
        [
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.gpus_per_node=8",
            "hydra.run.dir=x",
            "deepspeed=ds.json",
            "+plan.profiles.box.memory_bytes=1",
            "parallel.tp=1,2",
            "-m",
        ]
    )
    check_keys({"plan": {"profiles": {"box": {"memory_bytes": 1}}}, "parallel": {"tp": 2}})
    with pytest.raises(Exception, match=r"parallel.tpp=2: .*did you mean parallel.tp\?"):
        check_keys({"parallel": {"tpp": 2}})
    with pytest.raises(Exception, match=r"parallel.tp=x: .*could not be converted to Integer"):
        check_overrides(["parallel.tp=1,x"])  # every value of a sweep


def test_debug_switch_shows_the_traceback(monkeypatch, capsys):
    from recipes.config import ConfigError
    from recipes.main import refuse

    for debug, traceback_shown in (("", False), ("1", True)):
        monkeypatch.setenv("GRIDTRAIN_DEBUG", debug)
        try:
            raise ConfigError("optim.lr=-1.0: must be > 0; a learning rate like optim.lr=1e-3")
        except ConfigError as e:
            with pytest.raises(SystemExit) as exit_:
                refuse(e)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.strip().splitlines()[-1].startswith("error: optim.lr=-1.0")
        assert ("Traceback" in err) == traceback_shown


def test_an_empty_embedded_split_is_refused_and_not_cached(tmp_path, monkeypatch):
    from recipes.training.data import DataError, embedded_corpus

    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    with pytest.raises(DataError, match="leaves no training tokens"):
        embedded_corpus(0.05, 1.0)
    assert not any(tmp_path.rglob("meta.json"))


def test_prepare_names_what_is_wrong_with_its_paths(tmp_path, capsys):
    from recipes.tools import prepare

    a_file = tmp_path / "a.txt"
    a_file.write_text("hello world\n" * 10)
    assert prepare.main(["--output", str(tmp_path / "out"), "/dev/null"]) == 2
    assert "/dev/null is not a regular file or directory" in capsys.readouterr().err
    assert prepare.main(["--output", str(a_file), str(a_file)]) == 2
    assert f"--output {a_file} is a file; give a directory" in capsys.readouterr().err
    assert prepare.main(["--output", str(tmp_path / "out"), str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
