"""The one Hydra entry all recipes share.

A recipe module is three lines (see ``recipes/gpt_tiny.py``); this module
resolves its config, then either

* trains as this rank, when launched by ``torchrun`` (every rank runs this),
* or, launched by plain ``python -m recipes.<name>``, spawns the dp×pp×tp local
  workers itself through PyTorch's elastic launcher (``launch.local``),
* or, with ``mode=plan`` / ``mode=recommend``, runs the planner (no process),
* or, with ``mode=calibrate``, measures this machine into a hardware profile (``recipes/tools/calibrate.py``),
* or, with ``mode=dryrun``, runs one step of chosen ranks on no hardware (``recipes/tools/dryrun.py``).

Run directory: ``outputs/<run id>`` where the id is one every rank shares
(``TORCHELASTIC_RUN_ID`` under torchrun, ``SLURM_JOB_ID`` on Slurm, an id fixed
in the torchelastic agent's store under a static rendezvous, else a timestamp plus
a random suffix taken by the single launching process), so ranks never split it by
resolving ``${now:}`` a second apart and two launches in the same second never
share it. Only rank 0 writes ``.hydra/``, ``config.yaml``, ``metrics.jsonl``; it
(or the launcher) first locks the directory (``recipes/training/runlock.py``): one live run
per directory.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launch.failures import failure_report
from launch.local import LocalWorldError, check_local_world, spawn_local, under_torchrun

from .config import ConfigError, Layout, RecipeConfig, model_config
from .tools.deepspeed import apply_deepspeed
from .training.exits import freeze_for_exit
from .training.sweep import JobFailed
from .validation import check_keys, check_overrides, check_values, resolve_aliases, resolve_dp, validate

_REGISTERED = False


def new_run_id() -> str:
    """A fresh id: local timestamp plus 6 random hex digits, so launches in the same second differ."""
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{secrets.token_hex(3)}"


def _agreed_through_agent_store() -> str | None:
    """Under a static rendezvous without an id: the first rank to ask fixes a fresh id in the torchelastic
    agent's store; every rank (and every restart attempt of the job) reads the same one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=60),
        )
        return store.compare_set("gridtrain/run_id", "", new_run_id()).decode()
    except (RuntimeError, OSError, ValueError):
        return None


def shared_run_id() -> str:
    """An id every rank of one job resolves identically, unique per launch (see module docstring)."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rid and rid != "none":
        return f"torchrun-{rid}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if "MASTER_PORT" in os.environ:  # static rendezvous without an id
        agreed = _agreed_through_agent_store()
        return agreed or f"job-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ['MASTER_PORT']}"
    return new_run_id()


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def register() -> None:
    """Register the schema and the resolvers the recipe YAML files use (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)
    OmegaConf.register_new_resolver("gridtrain_run_id", shared_run_id, use_cache=True)
    OmegaConf.register_new_resolver("gridtrain_hydra_subdir", lambda: ".hydra" if _is_rank0() else None)
    _REGISTERED = True


def _typed(cfg: DictConfig) -> RecipeConfig:
    return OmegaConf.to_object(cfg)


#: how long a rank that raised waits before it exits (see :func:`worker`); the launcher polls every 0.1 s
FAILED_RANK_LINGER_S = 2.0


def worker(rc: RecipeConfig, run_dir: str, layout: Layout | None = None) -> dict[str, Any]:
    """Entry point of one spawned or torchrun-launched rank (``layout``: this process validated already).

    A rank that raises has its traceback written to torchelastic's error file (``record``), which the
    launcher reports once (``launch.failures``); it then leaves with status 1 through ``os._exit``, since an
    interpreter teardown with gloo's threads still running aborts (SIGABRT), which would hide the exception.
    It leaves :data:`FAILED_RANK_LINGER_S` late: torch's launcher names the first rank it finds dead, and a
    survivor whose collective failed because a peer was killed must not be found before that peer."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from .training.flight import dump_on_error, torch_recorder_env
    from .training.trainer import train

    os.environ.update(torch_recorder_env(run_dir))  # torch's NCCL flight recorder, before any group exists
    try:
        summary = record(train)(rc, run_dir, layout)
        freeze_for_exit()  # the rank's work is done: it returns its summary and its process ends
        return summary
    except Exception as e:
        dump_on_error(run_dir, e)  # this rank's flight recorder to <run>/flight (python -m recipes.diagnose)
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            raise  # nobody reads an error file: the traceback goes to stderr as usual
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(FAILED_RANK_LINGER_S)
        os._exit(1)


def fail(message: str, code: int) -> NoReturn:
    """Print ``message`` (an ``error: ...`` line) as the last line of stderr and exit ``code`` (in a
    Hydra multirun: fail this job only, so the sweep goes on and ends with its table)."""
    print(message, file=sys.stderr, flush=True)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise JobFailed(code, message.removeprefix("error: ")) from None
    raise SystemExit(code)


def refuse(e: Exception) -> NoReturn:
    """Print ``error: <message>`` as the last line of stderr and exit 2 (see :func:`fail`).
    ``GRIDTRAIN_DEBUG=1`` also prints the traceback."""
    if os.environ.get("GRIDTRAIN_DEBUG", "") not in ("", "0"):
        traceback.print_exception(e)
    fail(f"error: {e}", 2)


_NOT_REPEATED = ("train.resume", "train.fault", "hydra.run.dir")  # a resume command sets or drops these


def resume_command(run_dir: str) -> str:
    """The command line that continues this run: the same recipe and overrides, ``train.resume=auto``
    in the same directory (a fault drill, ``train.fault``, is not repeated)."""
    hc = HydraConfig.get()
    keep = [o for o in [*hc.overrides.hydra, *hc.overrides.task] if o.lstrip("+~").split("=")[0] not in _NOT_REPEATED]
    keep = [o for o in keep if not o.startswith(("hydra.mode=", "hydra/"))]
    words = ["python", "-m", f"recipes.{hc.job.config_name}", *keep, "train.resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(w) for w in words)


def _fresh_run_dir() -> bool:
    """This run's directory is a new timestamped one (no ``hydra.run.dir``, no torchrun/Slurm job id)."""
    hc = HydraConfig.get()
    given = any(o.lstrip("+").startswith("hydra.run.dir=") for o in hc.overrides.hydra)
    return hc.mode == RunMode.RUN and not given and not os.environ.get("SLURM_JOB_ID")


def _before_workers(rc: RecipeConfig, layout: Layout, run_dir: str, *, rank: int = 0, world: int = 1) -> None:
    """What reads the machine and files before any worker or collective: ``train.resume=auto``'s
    target, preflight, the data's size (a warning); notes on rank 0 only."""
    from .training.autoresume import resolve_auto
    from .training.data import batch_shortfalls
    from .training.preflight import preflight

    fresh = not under_torchrun() and _fresh_run_dir()
    note = resolve_auto(rc, run_dir, recipe=HydraConfig.get().job.config_name, fresh=fresh)
    if note and rank == 0:
        print(f"note: {note}", file=sys.stderr, flush=True)
    preflight(rc, layout, run_dir, rank=rank, world=world)
    for warning in batch_shortfalls(rc, layout.model.seq_len) if rank == 0 else ():
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def _ended(summary: dict[str, Any]) -> dict[str, Any]:
    """A run that stopped early: the divergence policy (exit 3) or a refused save
    (``train.ckpt_on_error=stop``, exit 1): its one line (rank 0 prints; every torchrun rank exits)."""
    if summary.get("stopped"):
        code = summary.get("exit_code", 1)
        if _is_rank0():
            fail(f"error: {summary['stopped']}", code)
        raise SystemExit(code)
    return summary


def task(cfg: DictConfig) -> dict[str, Any] | None:
    try:
        check_keys(OmegaConf.to_container(cfg, resolve=False))  # what `+key=value` added
        rc = _typed(cfg)
        run_dir = HydraConfig.get().runtime.output_dir
        resolve_aliases(rc)
        if rc.deepspeed:
            world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
            apply_deepspeed(rc, rc.deepspeed, resolve_dp(rc.parallel, world))
        if rc.model.target and rc.mode != "train":  # train: validate() checks it
            from .training.target_model import check_target

            check_target(rc, model_config(rc.model))
        if rc.mode in ("plan", "recommend"):
            from .tools.plan import run_plan

            check_values(rc)  # single-key ranges hold wherever the run would go
            return run_plan(rc, run_dir, quiet=HydraConfig.get().mode == RunMode.MULTIRUN)  # sweeps: one table
        if rc.mode == "calibrate":
            from .tools.calibrate import run_calibrate

            if under_torchrun():  # every rank would measure, spawn its own collective jobs and write the profile
                raise ConfigError(
                    "mode=calibrate measures this machine from one process and spawns its own ranks for the "
                    "collectives: run `python -m recipes.<recipe> mode=calibrate plan.world_size=N` without torchrun"
                )
            check_values(rc)
            return run_calibrate(rc, run_dir)
        if rc.mode == "dryrun":
            from .tools.dryrun import run_dryrun

            check_values(rc)
            found = run_dryrun(rc, run_dir)
            if found["misplaced"] or found["sequence_problems"]:  # a would-be NCCL error or hang: fail
                print(
                    f"error: dry run found {found['misplaced']} tensor(s) off the rank's device and "
                    f"{found['sequence_problems']} call-sequence mismatch(es); see {run_dir}/dryrun.json",
                    file=sys.stderr,
                )
                raise SystemExit(1)
            return found
        if under_torchrun():  # every rank, before any collective: a clean message everywhere
            world = int(os.environ["WORLD_SIZE"])
            layout = validate(rc, world_size=world)
            _before_workers(rc, layout, run_dir, rank=int(os.environ.get("RANK", "0")), world=world)
            return _ended(worker(rc, run_dir, layout))  # validate() runs once per process
        layout = validate(rc, world_size=None)
        check_local_world(layout.world_size, oversubscribe=rc.parallel.oversubscribe)  # cheapest first
        _before_workers(rc, layout, run_dir)
    except (ConfigError, LocalWorldError) as e:
        refuse(e)
    try:
        results = spawn_local(worker, layout.world_size, rc, run_dir)
    except ChildFailedError as e:  # a rank raised or died: its traceback, then one line saying how to go on
        trace, line = failure_report(e, run_dir, resume_command(run_dir))
        if trace:
            print(trace, file=sys.stderr)
        fail(line, 1)
    summary = _ended(results[0])
    loss = summary.get("final_loss")
    print(
        f"done: {summary.get('steps')} steps"
        + (f", final loss {loss:.4f}" if loss is not None else " (nothing left to train)")
        + f", run directory {run_dir}"
    )
    if summary.get("preempted"):  # a completed pre-emption save is a clean exit (status 0)
        print(f"stopped by a signal with a checkpoint; continue with: train.resume=auto hydra.run.dir={run_dir}")
    return summary


_HELP_FLAGS = {"-h", "--help", "--hydra-help", "-i", "--info", "-sc", "--shell-completion"}


def cli_overrides(argv: list[str]) -> list[str]:
    """The override arguments of a Hydra command line (flags and their values removed)."""
    from hydra._internal.utils import get_args_parser

    if _HELP_FLAGS & set(argv):
        return []
    args, rest = get_args_parser().parse_known_args(argv)
    return list(args.overrides or []) + [a for a in rest if not a.startswith("-")]


def run_recipe(config_name: str) -> None:
    """``@hydra.main`` for the recipe whose YAML is ``recipes/conf/<config_name>.yaml``.

    Overrides are checked against the schema first (an unknown key or a value of the wrong type
    is one ``error:`` line and exit 2, not Hydra's multi-line exit 1)."""
    register()
    try:
        check_overrides(cli_overrides(sys.argv[1:]))
    except ConfigError as e:
        refuse(e)
    hydra.main(version_base="1.3", config_path="conf", config_name=config_name)(task)()
    freeze_for_exit()  # every job has ended: nothing is left but the interpreter's exit
