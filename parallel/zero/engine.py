"""``ZeroDataParallel``: sharded data parallelism (ZeRO stages 0–3) over one DP group.

Wrap any ``nn.Module``; each DP rank feeds its own slice of the global batch::

    zdp = ZeroDataParallel(model, ZeroConfig(stage=2), dp_group=groups.dp,
                           optimizer_factory=lambda groups: torch.optim.AdamW(groups, lr=1e-3))
    for micro in range(n_micro):
        with zdp.no_sync() if micro < n_micro - 1 else contextlib.nullcontext():
            zdp.backward(loss_fn(zdp(x[micro]), y[micro]) / n_micro)
    stats = zdp.step()          # {"grad_norm", "skipped", "loss_scale"}
    zdp.zero_grad()

The step averages gradients over DP ranks, so ``loss`` is each rank's mean
over its own samples and the step is the mean over the global batch.

Stages (Ψ parameters, N = DP size; :mod:`parallel.zero.theory` has the bytes):

0. every rank holds everything; gradients are all-reduced bucket by bucket.
1. the optimizer state (fp32 master, moments) is sharded: gradients are
   reduce-scattered, each rank steps its shard, parameters are all-gathered.
2. gradients are sharded too: a bucket is reduce-scattered as soon as all its
   gradients are accumulated (``register_post_accumulate_grad_hook``) and the
   full gradients are freed.
3. parameters are sharded too: a unit (``units``: e.g. the transformer blocks)
   is all-gathered just before its forward and again before its backward and
   freed right after; the next unit's gather is launched ahead (prefetch).
   Parameters outside every unit form one more unit, gathered when the
   wrapped module's forward starts and kept until the optimizer step (once per step).

Gradient accumulation: under :meth:`no_sync` stages 0–1 only accumulate, and
communicate once, on the last micro-batch (or at :meth:`step`); inside
:meth:`sync_gradients` (a pipeline's last backward of each chunk) they launch
each bucket's reduction as its gradients become final. By default (``accumulate="sharded"``) stages 2–3
reduce-scatter every micro-batch into the accumulated gradient shard: keeping
the full gradient across micro-batches would give up the memory these stages
exist to save (DeepSpeed does the same). ``accumulate="unsharded"`` (stages 2–3,
``parallel.zero_accumulate``) makes FSDP2's choice instead: under :meth:`no_sync` each micro-batch's
gradient is added into a full fp32 buffer per bucket (``g·Ψ`` bytes while
accumulating, :func:`parallel.zero.theory.accumulation_grad_bytes`) and the
step's last backward reduce-scatters it once — m× fewer gradient bytes.

Overlap: with ``overlap=True`` a bucket's collective is launched, asynchronous,
from the hook of its last gradient, while backward goes on; all are waited for
when backward ends. With ``overlap=False`` they are launched after backward.
What hides behind what, and the in-flight cap, are :mod:`parallel.overlap`'s table (the planner's too).

Other groups: ``tp_group`` (parameters replicated across TP enter the norm once;
gradients of sequence-parallel parameters are summed over it),
``embedding_group`` (a word embedding tied across the first and last pipeline
stage: its gradient is summed over both, and enters the norm once),
``clip_groups`` (further groups the squared norm is summed over, e.g. PP),
``expert_group`` / ``ep_group`` (MoE: parameters marked :func:`parallel.params.mark_expert`
get buckets of their own reduced and sharded over ``expert_group`` — ``groups.edp`` — instead
of ``dp_group``, still divided by the dp size since each already sums every ep rank's tokens;
in the norm they are summed over ``dp_group`` from stage 1 on, over ``ep_group`` at stage 0).
Those parameters get buckets of their own, so the extra ``all_reduce`` acts on
their shard alone, after the DP reduction, at every stage.

Mixed precision (``precision``): the module's parameters are held in bf16/fp16,
floating-point inputs are cast to it, and the optimizer steps fp32 master
weights (its own shard from stage 1 on). Gradients accumulate in an fp32 buffer
at every precision (the main gradient, :mod:`parallel.zero.bucket`) and travel
in ``comm_dtype``, by default fp32 (:data:`parallel.zero.theory.DEFAULT_COMM_DTYPE`;
``"bf16"`` halves the traffic for one bf16 rounding of each sum). fp16 scales the loss dynamically
(:class:`~parallel.zero.scaler.DynamicLossScaler`); a step whose gradients hold
an inf/NaN on any rank of the DP, TP or ``clip_groups`` is skipped on all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..params import is_expert, wants_weight_decay
from .bucket import FlatBucket
from .config import ZeroConfig
from .grads import GradientSync
from .layout import ZeroConfigError, plan_buckets
from .norm import clip_coefficient, counted_ranges, global_norm, global_sq_norm, local_sq_norm
from .offload import HostCopier, host_step
from .packing import extra_reduce as packing_extra_reduce
from .policy import policy
from .scaler import DynamicLossScaler
from .state import StateDictMixin
from .units import UnitGatherer


def _extra_reduce(name: str, p: nn.Parameter, zdp) -> str:
    """The group a parameter's gradient is also summed over, refused if that group was not given."""
    extra = packing_extra_reduce(p)  # the bucket class's rule: parallel/zero/packing.py
    if extra and zdp.extra_groups[extra] is None:
        what = "a tied embedding" if extra == "embedding" else "sequence-parallel"
        raise ZeroConfigError(
            f"parameter {name!r} is marked {what}: its gradient must also be summed over the "
            f"{extra} group; pass {extra}_group=groups.{extra} to ZeroDataParallel"
        )
    return extra


def host_flag(flag: torch.Tensor) -> bool:
    """Read a 0-dim bool ``flag`` on the host (a device synchronisation).

    A tensor without storage (``meta``: the dry run) has no value; it reads as
    False, so a dry run takes a clean step, the path that allocates the optimizer state.
    """
    if flag.device.type == "meta":
        return False
    return bool(flag)


class ZeroDataParallel(GradientSync, StateDictMixin, nn.Module):
    """Wrap ``module`` for ZeRO data parallelism over ``dp_group`` as ``config`` says
    (:class:`~parallel.zero.config.ZeroConfig`; see the module docstring).

    ``optimizer_factory(param_groups)`` builds any elementwise torch optimizer
    over the flat fp32 shards (group 0 with weight decay, group 1 with
    ``weight_decay=0``). ``units``: stage 3's gather granularity. ``loss_scaler``: fp16's
    :class:`DynamicLossScaler` (default settings if None). The process groups are
    the module docstring's; None where that dimension is 1.
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        *,
        optimizer_factory: Callable[[list[dict]], torch.optim.Optimizer],
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None = None,
        embedding_group: dist.ProcessGroup | None = None,
        clip_groups: Sequence[dist.ProcessGroup | None] = (),
        expert_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        units: Sequence[nn.Module] | None = None,
        loss_scaler: DynamicLossScaler | None = None,
    ):
        super().__init__()
        self.config = config
        stage, self.offload, self.keep_full = config.stage, config.offload, config.keep_full
        self.param_dtype, self.comm_dtype = config.param_dtype, config.wire_dtype
        self.extra_groups = {"tp": tp_group, "embedding": embedding_group}
        for name, p in module.named_parameters():
            _extra_reduce(name, p, self)
        # every setting is checked above, on every rank, before the first collective
        self.module, self.stage, self.dp_group, self.overlap = module, stage, dp_group, config.overlap
        self.policy = policy(stage)  # the stage's behaviour, read by name below (parallel/zero/policy.py)
        self.dp_size = comm.group_size(dp_group)
        self.dp_rank = torch.distributed.get_rank(dp_group) if self.dp_size > 1 else 0
        self.grad_clip, self.tp_group = config.grad_clip, tp_group
        self.expert_group = expert_group if expert_group is not None else dp_group
        self.expert_norm_group = None if self.policy.shards_optimizer else ep_group  # stage 0: experts differ over ep
        self.norm_groups = (
            ([dp_group] if self.policy.shards_optimizer else []) + ([tp_group] if tp_group else []) + list(clip_groups)
        )
        self.scaler = (loss_scaler or DynamicLossScaler()) if self.param_dtype == torch.float16 else None
        self.units = list(units or [])
        self._build_buckets(config.bucket_mb)
        groups = [
            {"params": [b.master for b in self.buckets if b.layout.weight_decay]},
            {"params": [b.master for b in self.buckets if not b.layout.weight_decay], "weight_decay": 0.0},
        ]
        self.optimizer = optimizer_factory([g for g in groups if g["params"]])
        self._host_copier = HostCopier(self.buckets[0].flat_param.device) if self.offload != "none" else None
        self._sync = True
        self._callback_queued = False
        self._in_flight: deque[FlatBucket] = deque()  # stages 2-3: reduce-scatters not yet waited for
        self._register_hooks()
        if self.policy.gathers_per_unit:
            self._unit_gatherer = UnitGatherer(self.module, self.units, self._unit_buckets)

    # construction ---------------------------------------------------------------
    def _build_buckets(self, bucket_mb: float) -> None:
        named = dict(self.module.named_parameters())
        unit_of: dict[int, int] = {}
        for u, unit in enumerate(self.units):
            for p in unit.parameters():
                if id(p) in unit_of and unit_of[id(p)] != u:
                    raise ZeroConfigError(
                        f"a parameter belongs to units {unit_of[id(p)]} and {u}; units must be disjoint"
                    )
                unit_of[id(p)] = u
        root = len(self.units)
        order = sorted(named.items(), key=lambda kv: unit_of.get(id(kv[1]), root))  # units, then the rest
        if (
            not self.policy.gathers_per_unit
        ):  # only stage 3 gathers per unit: fewer, larger buckets are fewer collectives
            unit_of = {}
        specs = [
            (n, tuple(p.shape), wants_weight_decay(p), unit_of.get(id(p), root), _extra_reduce(n, p, self))
            for n, p in order
            if p.requires_grad
        ]
        if not specs:
            raise ZeroConfigError("the module has no trainable parameters")
        elem = torch.finfo(self.param_dtype).bits // 8
        sizes = dict(bucket_bytes=int(bucket_mb * 2**20), element_size=elem)
        self.layouts = plan_buckets([s for s in specs if not is_expert(named[s[0]])], dp=self.dp_size, **sizes)
        edp = comm.group_size(self.expert_group)
        experts = plan_buckets([s for s in specs if is_expert(named[s[0]])], dp=edp, **sizes)
        self.layouts += [replace(lay, index=len(self.layouts) + i) for i, lay in enumerate(experts)]
        expert_index = {lay.index for lay in self.layouts[len(self.layouts) - len(experts) :]}
        edp_rank = torch.distributed.get_rank(self.expert_group) if edp > 1 else 0
        self.buckets: list[FlatBucket] = []
        self._param_bucket: dict[nn.Parameter, FlatBucket] = {}
        self._slot_index: dict[nn.Parameter, int] = {}
        tp_rank = torch.distributed.get_rank(self.tp_group) if self.tp_group else 0
        emb = self.extra_groups["embedding"]
        first_stage = (torch.distributed.get_rank(emb) if emb else 0) == 0
        for layout in self.layouts:
            params = [named[s.name] for s in layout.slots]
            bucket = FlatBucket(
                layout,
                params,
                self.config,
                dp_rank=edp_rank if layout.index in expert_index else self.dp_rank,
                group=self.expert_group if layout.index in expert_index else self.dp_group,
            )
            bucket.expert = layout.index in expert_index
            bucket.norm_ranges = counted_ranges(layout, bucket.lo, bucket.hi, params, count_replicated=tp_rank == 0)
            if layout.extra_reduce == "embedding" and not first_stage:
                bucket.norm_ranges = []  # a tied embedding enters the norm once, on the first stage
            self.buckets.append(bucket)
            self._param_bucket.update({p: bucket for p in params})
            self._slot_index.update({p: i for i, p in enumerate(params)})
        self._unit_buckets = [[b for b in self.buckets if b.layout.unit == u] for u in range(root + 1)]

    # forward / backward -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.param_dtype != torch.float32:
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the fp16 loss scale applied."""
        self.scale_loss(loss).backward()

    # the fp16 loss scale: applied and removed here, nowhere else ----------------------
    @property
    def loss_scale(self) -> float:
        """The scale this step's backwards multiply the loss by (1 unless fp16); :meth:`step`
        divides the gradients by it (with the DP mean) and then may change it."""
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` × :attr:`loss_scale` in fp32, what backward differentiates (fp32/bf16: ``loss``)."""
        return loss.float() * self.scaler.scale if self.scaler else loss

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss value :meth:`scale_loss` produced, divided back (fp32/bf16: ``loss``); before
        :meth:`step`, which may change the scale."""
        return loss.detach().float() / self.scaler.scale if self.scaler else loss

    # the optimizer step -------------------------------------------------------------

    def step(self, norm: bool = True) -> dict:
        """Reduce gradients, clip, step the optimizer on this rank's shard, publish parameters.

        Returns ``{"grad_norm": tensor, "skipped": tensor, "loss_scale": float}``:
        ``grad_norm`` (0-dim fp32, on the device) is the global norm before clipping
        (one scalar all-reduce per group in ``norm_groups``), ``skipped`` (0-dim bool,
        on the device) says whether the step was skipped (a non-finite norm: an
        inf/NaN gradient on some rank), ``loss_scale`` the scale the next backward
        uses (1 unless fp16). A skipped step changes no parameter and no optimizer state.

        Host reads: clipping is decided on the device (the coefficient multiplies the
        gradients). The skip is decided on the device too when the optimizer takes a
        ``found_inf`` tensor (torch's fused Adam/AdamW/SGD, which the trainer uses on
        GPUs): no host read at all. Otherwise, and under fp16 (the loss scaler is host
        bookkeeping), the flag is read once per step — as Megatron-LM and torch's
        GradScaler do.

        ``norm=False`` (a step nobody logs): without clipping and without fp16's scaler nothing
        needs the norm, so it is not computed (no reduction, no collective) and ``grad_norm``
        and ``skipped`` are None; the step is taken as is, as DDP and FSDP take it. Offloaded
        (``offload``), the host step reads the skip flag anyway, so the norm is always computed.
        """
        grads = self._finish_gradients()
        wanted, norm, found_inf, coef = norm, None, None, None
        if wanted or self.grad_clip is not None or self.scaler is not None or self._host_copier is not None:
            local = local_sq_norm(grads, [b.norm_ranges for b in self.buckets])
            if self.expert_norm_group is not None and any(b.expert for b in self.buckets):  # stage 0 MoE:
                expert = local_sq_norm(grads, [b.norm_ranges if b.expert else [] for b in self.buckets])
                local = local - expert + global_sq_norm(expert, [self.expert_norm_group])  # + other ep ranks'
            norm = global_norm(local, self.norm_groups)
            found_inf = ~torch.isfinite(norm)
            coef = clip_coefficient(norm, self.grad_clip)
            if self._host_copier is not None:
                return host_step(self, norm, found_inf, coef)
        for b, g in zip(self.buckets, grads):
            b.master.grad = g.mul_(coef) if coef is not None else g
        device_skip = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
        skipped = None if found_inf is None or (device_skip and not self.scaler) else host_flag(found_inf)
        if self.scaler:
            self.scaler.update(skipped)
        for b in self.buckets if found_inf is not None else ():
            if b.compressor is not None:  # a skipped step's gradients leave no error-feedback residual
                b.compressor.residual.masked_fill_(found_inf, 0.0)
        if device_skip:  # the fused kernels leave params and state as they were (None: no skip decided)
            self.optimizer.found_inf = found_inf.float() if found_inf is not None else None
        if not skipped:
            self.optimizer.step()
            for b in self.buckets:
                b.publish_master()
        for b in self.buckets:
            b.master.grad = None
        self.zero_grad()
        return {"grad_norm": norm, "skipped": found_inf, "loss_scale": self.loss_scale}

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()
