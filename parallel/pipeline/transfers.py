"""How a pipeline stage posts and awaits its transfers (the p2p half of :mod:`.executor`).

:class:`StageTransfers` is the part of :class:`~.executor.PipelineExecutor` that moves tensors
between stages; it reads the executor's stage facts (``stage_ranks``, ``pp_group``, ``tp``, ...)
and fills ``_received`` from ``_outbox``.

* each batch of consecutive transfers is one ``comm.exchange`` on ``pp_group``, posted where
  the list puts it. A received tensor is awaited by the computation that reads it, not at its batch,
  so a computation the list places in between runs while it is in flight. The group's transport
  (:func:`parallel.comm.transport`) says what completes what: where each op completes alone
  (``Posted.sends_alone``) a batch with receives completes its sends at once, else its first
  reader awaits the whole batch; where it ``posts_receives_early``, a batch also posts the next
  batch's receives, in list order (every send meets the same receive). A batch of sends alone is
  awaited when the next batch is posted. Every post is at or before its point in the list and
  every wait at or after the simulator's: every schedule it proves deadlock-free stays so, and
  its timeline is an upper bound. A step that raises may leave receives posted ahead: its groups
  are not reused (the trainer ends the job on any error). In the 1F1B lists every receive is read
  by the very next computation (:data:`parallel.overlap.PIPELINE_P2P`).
* with ``tp_group``: this TP rank's slice travels, one ``all_gather`` rebuilds it (:mod:`.executor`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from .. import comm
from .schedules import (
    P2P,
    Backward,
    BackwardInput,
    Compute,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
)


def transfer_split(tp: int, sequence_parallel: bool) -> int:
    """Into how many TP shares a pipeline transfer is cut (Megatron's scatter-gather): ``tp`` where the
    activation is replicated over TP (no sequence parallelism): each TP rank sends 1/tp of it over the
    pipeline and the receiver rebuilds it with one ``all_gather`` on the TP group; 1 under sequence
    parallelism, whose TP ranks hold different tokens. The engine passes the TP group to the executor by
    this rule and the planner prices the transfer by it."""
    return tp if tp > 1 and not sequence_parallel else 1


class _InFlight(NamedTuple):
    """A posted receive: its buffer, the handles that complete it, and its batch's sent tensors,
    kept alive until then."""

    buffer: torch.Tensor
    waits: list
    sent: list[torch.Tensor]


def receives_ahead(items: Sequence[Compute | list[P2P]]) -> list[tuple[P2P, ...]]:
    """Per item: for a batch, the receives of the next batch in the list (none for a computation)."""
    out: list[tuple[P2P, ...]] = []
    for i, item in enumerate(items):
        later = next((b for b in items[i + 1 :] if isinstance(b, list)), []) if isinstance(item, list) else []
        out.append(tuple(a for a in later if isinstance(a, (RecvActivation, RecvGrad))))
    return out


class StageTransfers:
    """The transfers of :class:`~.executor.PipelineExecutor` (a base class; see the module docstring)."""

    def _start_transfers(self) -> None:
        """A step's fresh state: nothing received, nothing pending."""
        self._received: dict[tuple[str, int, int], torch.Tensor | _InFlight] = {}
        self._pending_sends: list = []
        self._send_buffers: list[torch.Tensor] = []

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of a replicated tensor (the whole of it without TP)."""
        flat = t.contiguous().view(-1)
        return flat if self.tp == 1 else flat.chunk(self.tp)[self.tp_rank].contiguous()

    def _transfer(self, batch: list[P2P], ahead: Sequence[P2P] = ()) -> None:
        """Post ``batch`` (its receives not posted yet), and the receives of ``ahead`` too, in list
        order (see the module docstring)."""
        sends, recvs, landing = [], [], []
        for a in batch:
            peer = self.stage_ranks[a.peer]
            if isinstance(a, (SendActivation, SendGrad)):
                kind = "act" if isinstance(a, SendActivation) else "grad"
                t = self._outbox.pop((kind, a.mb, a.chunk))
                if t is None or tuple(t.shape) != self.activation_shape or t.dtype != self.dtype:
                    raise ScheduleError(
                        f"stage {self.stage}: {a} has shape {None if t is None else tuple(t.shape)} / "
                        f"{None if t is None else t.dtype}, expected {self.activation_shape} / {self.dtype}"
                    )
                sends.append((self._slice(t), peer))
        own_recvs = False
        for a in (*batch, *ahead):
            if isinstance(a, (RecvActivation, RecvGrad)):
                key = ("act" if isinstance(a, RecvActivation) else "grad", a.mb, a.chunk)
                own_recvs = own_recvs or a in batch
                if key in self._received:
                    continue  # posted ahead with the previous batch
                buf = torch.empty(math.prod(self.activation_shape) // self.tp, dtype=self.dtype, device=self.device)
                recvs.append((buf, self.stage_ranks[a.peer]))
                landing.append((key, buf))
        posted = comm.exchange(sends, recvs, group=self.pp_group)
        # the previous send-only batch: matched by now in the usual case; awaiting it here,
        # and not earlier, lets a sender compute instead of idling until its peer posts
        # the receive, and keeps at most one batch of sent tensors alive
        self._complete_sends()
        sent = [t for t, _ in sends]
        if not own_recvs:  # a batch of sends alone: awaited with the next batch, as the simulator assumes
            self._pending_sends, self._send_buffers = posted.sends, sent
        for handle in posted.sends_alone if own_recvs else ():  # see the module docstring
            handle.wait()
        # where the receives' handles also complete the sends (a batch completing as a whole), the sent
        # tensors stay alive until a receive is awaited; where the sends completed on their own, nothing does
        kept = [] if posted.sends_alone else sent
        for (key, buf), waits in zip(landing, posted.receives):
            self._received[key] = _InFlight(buf, waits, kept)

    def _complete_sends(self) -> None:
        """Wait for the sends still pending (of the last batch of sends alone)."""
        for handle in self._pending_sends:
            handle.wait()
        self._pending_sends, self._send_buffers = [], []

    def _await_input(self, a: Compute) -> None:
        """Complete the receive ``a`` reads (before its computation starts), rebuilding the
        whole tensor from the TP shares (scatter-gather); nothing if it reads none."""
        key = (
            ("act", a.mb, a.chunk)
            if isinstance(a, Forward) and not self._is_first(a.chunk)
            else ("grad", a.mb, a.chunk)
            if isinstance(a, (Backward, BackwardInput)) and not self._is_last(a.chunk)
            else None
        )
        pending = self._received.get(key)
        if not isinstance(pending, _InFlight):
            return  # none, or already complete
        for handle in pending.waits:
            handle.wait()
        buf = pending.buffer
        if self.tp > 1:
            whole = torch.empty(buf.numel() * self.tp, dtype=self.dtype, device=self.device)
            comm.all_gather(whole, buf, group=self.tp_group)
            buf = whole
        self._received[key] = buf.view(self.activation_shape)
