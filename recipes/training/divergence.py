"""The divergence policy: skipped steps are said, a run that keeps skipping (or turns NaN) stops.

A step whose gradient norm is inf/NaN on any rank is skipped on every rank (ZeRO's step:
nothing changes, no parameter and no optimizer state). :class:`SkipWatch` counts those
steps on the device, so an unlogged step reads nothing on the host: per step three
in-place kernels (the run of skipped steps in a row, the longest run and the count since
the last read); on a logged step one host read of the three. Then

* a ``warning:`` line names the skipped step(s), the reason (inf/NaN gradient norm, and
  whether the loss itself was finite) and the count so far;
* more than ``train.max_skipped_steps`` in a row (0: no limit): the run stops before it
  saves again — the last checkpoint written before the run went bad stays the newest —
  and every rank returns the reason, which the launcher prints as one ``error:`` line
  (exit :data:`~recipes.training.exits.EXIT_DIVERGED`);
* a checkpoint due while the latest step was skipped is not written (its weights are
  the ones that give inf/NaN gradients), so it can never displace a good one.

With skipping off between logged steps (fp32/bf16 without ``train.grad_clip``: an unlogged
step computes no gradient norm, so a NaN gradient is applied), a non-finite loss on the next
logged step stops the run the same way: the weights may be NaN since the last logged step.

Every rank decides from the same numbers (the norm and the skip are agreed over the step's
groups, the logged loss is reduced over them): all ranks stop on the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def describe_values(rec: dict) -> str:
    """Why a logged step is bad, in words: which of the loss or the gradient norm is inf/NaN."""
    loss, norm = rec.get("loss"), rec.get("grad_norm")
    if not _finite(loss):
        return f"the loss is {loss}" + (f" and the gradient norm {norm}" if norm is not None else "")
    if norm is not None and not _finite(norm):
        return f"the gradient norm is {norm}, the loss {loss:.4g} is finite"
    return f"loss {loss:.4g}, gradient norm {norm}"


@dataclass
class Verdict:
    """What a logged step's check found: warning lines to print and, if the run must stop, why."""

    warnings: list[str]
    stop: str | None = None


class SkipWatch:
    """Skipped steps counted on the device; checked on logged steps (see the module doc)."""

    def __init__(self, limit: int, device: torch.device, *, lr: float, grad_clip: float, precision: str):
        self.limit = limit
        zero = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        self._run, self._longest, self._since = zero(), zero(), zero()  # in a row; longest; since the read
        self.total = 0  # skipped steps so far (as of the last logged step)
        self.streak = 0  # skipped steps in a row up to the last logged step
        self.unchecked = False  # a step since the last read took no skip decision (no norm computed)
        self.last_read_step = 0
        self._hint = f"optim.lr (now {lr:g})" + ("" if grad_clip else ", set train.grad_clip=1.0")
        self._precision = precision

    def after_step(self, rec: dict) -> None:
        """Every step, every rank, no host read: fold this step's skip decision into the counts."""
        skipped = rec.get("skipped")
        if skipped is None:  # nothing decided: the step was applied whatever its gradients
            self.unchecked = True
            return
        if isinstance(skipped, bool):  # a read step: the host knows already
            if skipped:
                self._run.add_(1)
                self._since.add_(1)
            else:
                self._run.zero_()
        else:
            s = skipped.to(torch.int64)
            self._run.add_(1).mul_(s)
            self._since.add_(s)
        self._longest.copy_(torch.maximum(self._longest, self._run))

    def check(self, step: int, rec: dict) -> Verdict:
        """A logged step (every rank): one host read of the counts; the warnings and the verdict."""
        run, longest, since = torch.stack([self._run, self._longest, self._since]).tolist()
        self._longest.zero_()
        self._since.zero_()
        first_unread = self.last_read_step + 1
        unchecked, self.unchecked, self.last_read_step = self.unchecked, False, step
        self.total += since
        self.streak = run
        out = Verdict([])
        if since:
            steps = (
                f"step {step}" if since == 1 and rec.get("skipped") else f"{since} of the steps {first_unread}–{step}"
            )
            why = describe_values(rec) if rec.get("skipped") else "an inf/NaN gradient norm"
            out.warnings.append(
                f"{steps} skipped: {why}; {self.total} skipped so far, {run} in a row "
                f"(train.max_skipped_steps={self.limit})"
            )
        if unchecked and not _finite(rec.get("loss")):
            out.stop = (
                f"training diverged: {describe_values(rec)} at step {step}, and the steps since step "
                f"{first_unread - 1} were not checked (an unlogged step without train.grad_clip computes no "
                f"gradient norm in {self._precision}, so an inf/NaN gradient is applied); lower {self._hint}, "
                f"or log every step (train.log_every=1) to skip such steps"
            )
        elif self.limit and longest > self.limit:
            out.stop = (
                f"training diverged: {longest} steps in a row skipped by step {step}, more than "
                f"train.max_skipped_steps={self.limit} (step {step}: {describe_values(rec)}); lower {self._hint}, "
                f"or raise train.max_skipped_steps"
            )
        return out

    @property
    def holds_save(self) -> bool:
        """A checkpoint now would hold weights whose gradients are inf/NaN: the latest step was skipped."""
        return self.streak > 0


def stop_message(reason: str, step: int, latest, ckpt_every: int = 0) -> str:
    """The one line a diverged run ends with: why, where it stopped, the checkpoint to go back to."""
    if latest is None:
        hint = "" if ckpt_every else " (train.ckpt_every=N saves one every N steps)"
        return f"{reason}; stopped after step {step}, no checkpoint was saved{hint}"
    return (
        f"{reason}; stopped after step {step} without saving: the last good checkpoint is {latest}; "
        f"resume from it with train.resume={latest}"
    )
