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

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..overlap import REDUCTIONS_IN_FLIGHT
from ..params import is_expert, wants_weight_decay
from .bucket import FlatBucket
from .compression import TopKCompressor
from .config import ZeroConfig
from .layout import ZeroConfigError, plan_buckets
from .norm import clip_coefficient, counted_ranges, global_norm, local_sq_norm
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


class ZeroDataParallel(StateDictMixin, nn.Module):
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
        self._build_buckets(config.bucket_mb, config.compression, config.topk_ratio)
        groups = [
            {"params": [b.master for b in self.buckets if b.layout.weight_decay]},
            {"params": [b.master for b in self.buckets if not b.layout.weight_decay], "weight_decay": 0.0},
        ]
        self.optimizer = optimizer_factory([g for g in groups if g["params"]])
        self._host_copier = HostCopier(self.buckets[0].flat_param.device) if self.offload != "none" else None
        self._sync = True
        self._callback_queued = False
        self._in_flight: deque[FlatBucket] = deque()  # stages 2-3: reduce-scatters not yet waited for
        hook = _weak_hook(self, "_on_grad_ready")
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._param_bucket]
        # the parameters outlive an engine that is dropped (a model wrapped again): its hooks go with it
        weakref.finalize(self, _remove_hooks, self._hooks)
        if self.policy.gathers_per_unit:
            self._unit_gatherer = UnitGatherer(self.module, self.units, self._unit_buckets)

    # construction ---------------------------------------------------------------
    def _build_buckets(self, bucket_mb: float, compression, topk_ratio: float) -> None:
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
            compressor = (
                TopKCompressor(layout.padded_numel, topk_ratio, self.comm_dtype, params[0].device)
                if compression
                else None
            )
            bucket = FlatBucket(
                layout,
                params,
                stage=self.stage,
                dp_rank=edp_rank if layout.index in expert_index else self.dp_rank,
                group=self.expert_group if layout.index in expert_index else self.dp_group,
                param_dtype=self.param_dtype,
                comm_dtype=self.comm_dtype,
                compressor=compressor,
                offload=self.offload,
                keep_full=self.keep_full,
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
        (loss.float() * self.scaler.scale if self.scaler else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (stages 0–1; see the module docstring)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @contextlib.contextmanager
    def sync_gradients(self) -> Iterator[None]:
        """Communicate during this backward even inside :meth:`no_sync` (stages 0–1).

        For the last backward of a micro-batch loop that runs under ``no_sync()``: each
        bucket's reduction launches (with ``overlap``) as soon as its last gradient is
        accumulated — a pipeline with several model chunks enters it around each chunk's
        last backward (``PipelineExecutor(final_backward=...)``); a bucket that spans chunks
        launches once the gradients of all of them are final."""
        previous, self._sync = self._sync, True
        try:
            yield
        finally:
            self._sync = previous

    def _communicates_now(self) -> bool:
        return self._sync or (self.policy.reduce_every_microbatch and not self.keep_full)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._param_bucket[param]
        once = not self.policy.reduce_every_microbatch and self._communicates_now()  # stages 0-1, this backward
        # before the gradient is taken in (a 16-bit gradient is then not added; an fp32 view of flat_grad
        # already was, by autograd: the step must not be taken after the refusal either way)
        if once and self.dp_size > 1:
            self._check_first_reduction(bucket, param)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if bucket.flat_grad is not None:
            bucket.take_grad(param, self._slot_index[param])
        elif self.keep_full:
            bucket.accumulate_full(param, self._slot_index[param])
        if not self._communicates_now():
            if self.keep_full:  # all of a unit's gradients are in: its backward is over, free its parameters
                bucket.ready += 1
                if bucket.ready == len(bucket.params) and self._frees_after_backward(bucket):
                    bucket.free_params()
            return
        if once and self.dp_size == 1:
            return  # one rank: nothing to overlap, the step reduces the accumulated gradient once
        bucket.ready += 1
        if self.overlap and bucket.ready == len(bucket.params):
            self._reduce(bucket, wait=False)
            if self._frees_after_backward(bucket):
                bucket.free_params()  # this micro-batch's backward of its unit is over

    def _check_first_reduction(self, bucket: FlatBucket, param: torch.Tensor) -> None:
        """Stages 0-1 reduce the accumulated gradient once per step: refuse (on every rank, as
        every rank runs the same backwards) a gradient that arrives in a communicating backward
        after its bucket's reduction started, or a second time in this step."""
        slot = self._slot_index[param]
        if bucket.reduced or bucket.arrived[slot]:
            name = next(n for n, q in self.module.named_parameters() if q is param)
            self._callback_queued = False  # an aborted backward runs no callback: the next one queues its own
            raise RuntimeError(
                f"ZeroDataParallel (stage {self.stage}): a second backward that communicates "
                f"before step(): the gradient of {name} arrived for a bucket "
                "already reduced over DP in this step (stages 0-1 reduce the accumulated gradient "
                "once per step; a gradient added after that reduction started would be lost or race "
                "with it). Run every backward but the last of an accumulation under "
                "`with zdp.no_sync():`, then step()"
            )
        bucket.arrived[slot] = 1

    def _reduce(self, bucket: FlatBucket, wait: bool) -> None:
        bucket.launch_reduction()
        if wait:
            bucket.finish_reduction()
        elif self.policy.reduce_every_microbatch:
            # the reduce-scatter's input is a temporary full gradient, alive until waited for: keep at
            # most REDUCTIONS_IN_FLIGHT (on NCCL the wait orders the stream; the host does not block)
            self._in_flight.append(bucket)
            while len(self._in_flight) > REDUCTIONS_IN_FLIGHT:
                self._in_flight.popleft().finish_reduction()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self._communicates_now():
            for b in self.buckets if self.keep_full else ():
                b.ready = 0
                if self._frees_after_backward(b):
                    b.free_params()
            return
        for b in self.buckets:
            if not self.overlap and b.ready == len(b.params) and b.has_unreduced_grads():
                self._reduce(b, wait=False)
        self._in_flight.clear()
        for b in self.buckets:
            if self.policy.reduce_every_microbatch:  # the shard takes this micro-batch's reduce-scatter before the next
                b.finish_reduction()
                b.ready = 0
            # stages 0-1 reduce once per step: step() waits, so with interleaving a chunk's reductions
            # overlap the other chunks' remaining backwards instead of blocking at this chunk's end
            if self._frees_after_backward(b) and not b.has_unreduced_grads():
                b.free_params()

    def _frees_after_backward(self, bucket: FlatBucket) -> bool:
        """Stage 3 frees a block unit once its backward has run (the unit's grad hook gathers
        it again for the next micro-batch's backward); the root unit has no such hook, so it
        stays gathered until the optimizer step publishes new parameters."""
        return self.policy.gathers_per_unit and bucket.layout.unit != len(self.units)

    # the optimizer step -------------------------------------------------------------
    def _finish_gradients(self) -> list[torch.Tensor]:
        """Reduce what backward left unreduced (unused parameters, no_sync); return fp32 grads, averaged."""
        for b in self.buckets:
            if b.has_unreduced_grads():
                self._reduce(b, wait=True)
            b.finish_reduction()
        self._in_flight.clear()
        divisor = self.dp_size * (self.scaler.scale if self.scaler else 1.0)
        grads = [b.main_grad() for b in self.buckets]
        for b, g in zip(self.buckets, grads):
            if divisor != 1:  # one process without a loss scale: nothing to average (a pass saved)
                g.div_(divisor)
            if b.layout.extra_reduce:  # tied embedding: + the other stage's; sequence parallel: + other TP ranks'
                comm.all_reduce(g, group=self.extra_groups[b.layout.extra_reduce])
            if self._host_copier is not None:  # offload: device -> host now, while later buckets finish
                self._host_copier.copy(b.host_grad, g)
        return grads

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
        if not norm and self.grad_clip is None and self.scaler is None and self._host_copier is None:
            for b, g in zip(self.buckets, grads):
                b.master.grad = g
            if getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self.optimizer.found_inf = None  # no skip decided: the fused kernels step
            self.optimizer.step()
            for b in self.buckets:
                b.publish_master()
                b.master.grad = None
            self.zero_grad()
            return {"grad_norm": None, "skipped": None, "loss_scale": 1.0}
        local = local_sq_norm(grads, [b.norm_ranges for b in self.buckets])
        if self.expert_norm_group is not None and any(b.expert for b in self.buckets):  # stage 0 MoE:
            expert = local_sq_norm(grads, [b.norm_ranges if b.expert else [] for b in self.buckets])
            local = local - expert + global_norm(expert, [self.expert_norm_group]).square()  # + other ep ranks'
        norm = global_norm(local, self.norm_groups)
        found_inf = ~torch.isfinite(norm)
        coef = clip_coefficient(norm, self.grad_clip)
        if self._host_copier is not None:
            return host_step(self, norm, found_inf, coef)
        for b, g in zip(self.buckets, grads):
            b.master.grad = g.mul_(coef) if coef is not None else g
        device_skip = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
        skipped = None if device_skip and not self.scaler else host_flag(found_inf)
        if self.scaler:
            self.scaler.update(skipped)
        for b in self.buckets:
            if b.compressor is not None:  # a skipped step's gradients leave no error-feedback residual
                b.compressor.residual.masked_fill_(found_inf, 0.0)
        if device_skip:
            self.optimizer.found_inf = found_inf.float()  # the fused kernels leave params and state as they were
        if skipped is None or not skipped:
            self.optimizer.step()
            for b in self.buckets:
                b.publish_master()
        for b in self.buckets:
            b.master.grad = None
        self.zero_grad()
        return {"grad_norm": norm, "skipped": found_inf, "loss_scale": self.scaler.scale if self.scaler else 1.0}

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()


def _remove_hooks(handles: list) -> None:
    """Remove every hook in ``handles`` and empty the list (it stays the same object)."""
    for h in handles:
        h.remove()
    handles.clear()


def _weak_hook(owner: Any, name: str) -> Callable[[torch.Tensor], None]:
    """A hook that calls ``owner.<name>(tensor)`` while ``owner`` lives, holding it only weakly.

    A tensor hook is kept by the tensor's C++ side, which Python's garbage collector cannot see
    through: a hook holding the engine (a bound method) would keep the engine, its model and its
    buffers alive after the last reference to them is gone (a GPU's memory never returned)."""
    ref = weakref.ref(owner)

    def hook(tensor: torch.Tensor) -> None:
        obj = ref()
        if obj is not None:
            getattr(obj, name)(tensor)

    return hook
