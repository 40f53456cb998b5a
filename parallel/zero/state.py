"""Checkpoint state of a :class:`~parallel.zero.engine.ZeroDataParallel`.

Two forms:

* **per rank** (:meth:`StateDictMixin.state_dict`): this rank's fp32 master
  shards, its optimizer's ``state_dict()`` (moments of its shards only) and the
  loss scaler; loads back only into the same layout (stage, DP size, buckets).
* **full** (:meth:`StateDictMixin.full_state_dict`): every parameter and every
  per-element optimizer state (``exp_avg``, ``momentum_buffer`` ...) as whole
  fp32 tensors keyed by parameter name, plus the optimizer's scalars
  (``step``). Gathering it is one ``all_gather`` on the DP group per bucket and
  per state tensor (stages 1–3; none at stage 0). It loads into *any* layout
  (:meth:`StateDictMixin.load_full_state_dict`): each rank cuts out its own
  shard — this is how a checkpoint moves to another DP size or ZeRO stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from .layout import ParamSlot, ZeroConfigError


@dataclass(frozen=True)
class ShardView:
    """One bucket's part of the training state this rank owns: what checkpoints read and write.

    ``master`` is the fp32 master shard, elements ``[lo, hi)`` of the bucket's flat
    layout, in which parameter ``params[i]`` occupies ``slots[i]`` (its name, shape and
    ``[offset, end)``). The optimizer's state for the shard is keyed by ``master``
    (:meth:`StateDictMixin.shard_optimizer_state`). Views, not copies: writing into
    ``master`` and then calling :meth:`StateDictMixin.publish_masters` loads weights.
    """

    master: torch.Tensor
    lo: int
    hi: int
    slots: tuple[ParamSlot, ...]
    params: tuple[nn.Parameter, ...]


def _full_flat(bucket, local: torch.Tensor) -> torch.Tensor:
    """The whole padded flat tensor of ``bucket`` from each rank's owned range."""
    if not bucket.policy.shards_optimizer:  # every rank holds the whole range
        return local.float()
    device = bucket.flat_param.device  # the collective's device, also when the shard is in host memory (offload)
    out = torch.empty(bucket.layout.padded_numel, dtype=torch.float32, device=device)
    comm.all_gather(out, local.to(device, torch.float32).contiguous(), group=bucket.group)
    return out


def _split(bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {s.name: flat[s.offset : s.end].view(s.shape).clone() for s in bucket.layout.slots}


def _owned(bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cut this rank's range out of whole per-parameter tensors."""
    flat = torch.zeros(bucket.layout.padded_numel, dtype=torch.float32, device=bucket.flat_param.device)
    for s in bucket.layout.slots:
        if s.name not in tensors:
            raise ZeroConfigError(f"full state dict lacks {s.name!r}")
        t = tensors[s.name]
        if tuple(t.shape) != s.shape:
            raise ZeroConfigError(f"{s.name!r}: checkpoint shape {tuple(t.shape)} ≠ model shape {s.shape}")
        flat[s.offset : s.end] = t.reshape(-1).to(flat)
    return flat[bucket.lo : bucket.hi]


class StateDictMixin:
    """State dict methods of ZeroDataParallel (needs ``buckets``, ``optimizer``, ``scaler``)."""

    def shards(self) -> list[ShardView]:
        """This rank's master shards with their parameters' places (the public checkpoint interface)."""
        return [ShardView(b.master, b.lo, b.hi, tuple(b.layout.slots), tuple(b.params)) for b in self.buckets]

    def shard_optimizer_state(self, shard: ShardView, create: bool = False) -> dict:
        """The optimizer's state of ``shard`` (``{}`` before the first step; ``create``: made and kept)."""
        return (
            self.optimizer.state.setdefault(shard.master, {}) if create else self.optimizer.state.get(shard.master, {})
        )

    def publish_masters(self) -> None:
        """Copy the (freshly loaded) master shards into the compute parameters, at every stage."""
        for b in self.buckets:
            b.publish_master()

    def _layout_key(self) -> dict:
        return {
            "stage": self.stage,
            "dp_size": self.dp_size,
            "buckets": [[(s.name, s.numel) for s in b.layout.slots] for b in self.buckets],
        }

    def state_dict(self) -> dict:  # noqa: D401 - per-rank ZeRO state, not nn.Module's
        """This rank's shard of the training state."""
        return {
            "layout": self._layout_key(),
            "dp_rank": self.dp_rank,
            "master": [b.master.detach().clone() for b in self.buckets],
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:  # noqa: D401
        """Load what :meth:`state_dict` returned on the same rank of the same layout."""
        if state["layout"] != self._layout_key() or state["dp_rank"] != self.dp_rank:
            raise ZeroConfigError(
                f"per-rank state of stage {state['layout']['stage']} dp {state['layout']['dp_size']} "
                f"rank {state['dp_rank']} does not fit stage {self.stage} dp {self.dp_size} rank "
                f"{self.dp_rank}; use full_state_dict()/load_full_state_dict() to reshard"
            )
        for b, m in zip(self.buckets, state["master"]):
            b.master.data.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_scaler(state["scaler"])
        self.publish_masters()

    def full_state_dict(self) -> dict:
        """Whole fp32 parameters and optimizer state by parameter name (collective over DP)."""
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict] = {}
        for b in self.buckets:
            params.update(_split(b, _full_flat(b, b.master.detach())))
            per_param: dict[str, dict] = {s.name: {} for s in b.layout.slots}
            for key, value in sorted(self.optimizer.state.get(b.master, {}).items()):
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == b.master.shape:
                    for name, t in _split(b, _full_flat(b, value)).items():
                        per_param[name][key] = t
                else:
                    for name in per_param:
                        per_param[name][key] = value.clone() if torch.is_tensor(value) else value
            optim.update(per_param)
        return {"params": params, "optimizer": optim, "scaler": self.scaler.state_dict() if self.scaler else None}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, in fp32 (collective over DP at stages 1–3)."""
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            out.update(_split(b, _full_flat(b, b.master.detach())))
        return out

    def load_full_state_dict(self, full: dict) -> None:
        """Load a :meth:`full_state_dict` saved under any stage and DP size."""
        for b in self.buckets:
            b.master.data.copy_(_owned(b, full["params"]))
            names = [s.name for s in b.layout.slots]
            per_param = [full["optimizer"].get(n, {}) for n in names]
            state = {}
            for key in sorted(set().union(*per_param)):
                first = per_param[0][key]
                if torch.is_tensor(first) and first.dim() > 0 and first.shape == b.layout.slots[0].shape:
                    owned = _owned(b, {n: st[key] for n, st in zip(names, per_param)})
                    state[key] = owned.to(b.master.device, copy=True)  # offload: the state lives on the host
                else:
                    state[key] = first.clone() if torch.is_tensor(first) else first
            if state:
                self.optimizer.state[b.master] = state
        self._load_scaler(full.get("scaler"))
        self.publish_masters()

    def _load_scaler(self, state) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)

    def held_bytes(self) -> dict:
        """Model-state bytes this rank holds now, counted from its tensors.

        Device: ``params``: compute parameters (stage 3: the shard plus whatever is
        gathered at the moment); ``grads``: gradient buffers; ``optimizer``: the
        separate fp32 master (16-bit precisions) plus every per-element optimizer
        state tensor (0-dim scalars such as Adam's ``step`` are left out); ``total``
        their sum. ``host`` (a key only under ``offload``): what it keeps in host memory instead (master,
        optimizer state, the gradient copy target, stage 3's parameter shards).
        """
        nbytes = lambda t: t.untyped_storage().nbytes()  # noqa: E731 - 0 once freed (stage 3)
        params = grads = optim = host = 0
        for b in self.buckets:
            on_host = b.offload != "none"
            shard = b.param_shard.nbytes if b.param_shard is not None else 0
            params += nbytes(b.flat_param) + (0 if b.params_on_host else shard)
            grads += sum(t.nbytes for t in (b.flat_grad, b.grad_shard) if t is not None)
            grads += sum(p.grad.nbytes for p in b.params if b.flat_grad is None and p.grad is not None)
            state = sum(
                v.nbytes
                for v in self.optimizer.state.get(b.master, {}).values()
                if torch.is_tensor(v) and v.dim() > 0 and v.shape == b.master.shape
            )
            master = b.master.nbytes if b.master_is_separate else 0
            if on_host:
                host += master + state + b.host_grad.nbytes + (shard if b.params_on_host else 0)
            else:
                optim += master + state
        out = {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
        return {**out, "host": host} if self.offload != "none" else out
