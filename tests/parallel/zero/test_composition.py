"""ZeRO composes with tensor and pipeline parallelism; the clipped global norm is the one-process norm.

The TP and PP here are minimal hand-written ones (Megatron's column/row split
with the f/g pair built on parallel.comm; a two-stage pipeline with blocking
send/recv), so the test depends on nothing but parallel.zero and the foundation.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.groups import build_groups
from parallel.params import mark_no_weight_decay, mark_sequence_parallel, mark_shared_embedding, mark_tp_sharded
from parallel.testing import run_ranks
from parallel.topology import Topology
from parallel.zero import ZeroConfig, ZeroConfigError, ZeroDataParallel

from .toy import BATCH, Block, D, adamw, batches, make_model, reference_run

CLIP, STEPS = 0.5, 6


class _CopyToTP(torch.autograd.Function):  # Megatron's "f": identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):  # Megatron's "g": all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class Mlp(nn.Module):
    """norm → fc1 (D → 2D) → relu → fc2 (2D → 1); with ``tp``: fc1 split by rows, fc2 by columns."""

    def __init__(self, tp_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, 1)
        for p in (self.norm.weight, self.norm.bias, self.fc1.bias, self.fc2.bias):
            mark_no_weight_decay(p)
        self.tp_group = tp_group
        if tp_group is not None:
            n, r = comm.group_size(tp_group), dist.get_rank(tp_group)
            rows = slice(r * 2 * D // n, (r + 1) * 2 * D // n)
            with torch.no_grad():
                self.fc1.weight = nn.Parameter(self.fc1.weight[rows].clone())
                self.fc1.bias = nn.Parameter(self.fc1.bias[rows].clone())
                self.fc2.weight = nn.Parameter(self.fc2.weight[:, rows].clone())
            mark_tp_sharded(self.fc1.weight, 0), mark_tp_sharded(self.fc1.bias, 0)
            mark_tp_sharded(self.fc2.weight, 1), mark_no_weight_decay(self.fc1.bias)

    def forward(self, x):
        h = self.norm(x)
        if self.tp_group is None:
            return self.fc2(torch.relu(self.fc1(h))).squeeze(-1)
        h = torch.relu(self.fc1(_CopyToTP.apply(h, self.tp_group)))
        out = _ReduceFromTP.apply(h @ self.fc2.weight.t(), self.tp_group) + self.fc2.bias
        return out.squeeze(-1)


def _dp_tp():
    g = build_groups(Topology(dp=2, pp=1, tp=2))
    per = BATCH // 2
    mine = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
    out = {}
    for stage in range(4):
        model = Mlp(g.tp)
        zdp = ZeroDataParallel(
            model, ZeroConfig(stage=stage, grad_clip=CLIP), dp_group=g.dp, optimizer_factory=adamw, tp_group=g.tp
        )
        losses, norms = [], []
        for x, y in batches(STEPS):
            loss = nn.functional.mse_loss(zdp(x[mine]), y[mine])
            zdp.backward(loss)
            norms.append(float(zdp.step()["grad_norm"]))
            total = loss.detach().clone()
            comm.all_reduce(total, group=g.dp)
            losses.append(total.item() / 2)
        out[stage] = (losses, norms, {n: p.numpy() for n, p in zdp.full_parameters().items()})
    return g.tp_rank, out


def test_zero_over_dp_with_tp_matches_one_process_and_counts_replicated_params_once():
    ref_losses, ref_norms, ref_params = reference_run(steps=STEPS, grad_clip=CLIP, make=Mlp)
    assert max(ref_norms) > CLIP
    results = run_ranks(_dp_tp, 4)
    for stage in range(4):
        shards = {r: res[stage][2] for r, res in ((tp, out) for tp, out in results)}
        for tp_rank, out in results:
            losses, norms, _ = out[stage]
            assert losses == pytest.approx(ref_losses, abs=1e-4)
            # replicated norm weights/biases counted twice would give a larger norm
            assert norms == pytest.approx(ref_norms, rel=1e-4), stage
        for name, p in ref_params.items():
            if name in ("fc1.weight", "fc1.bias"):
                whole = torch.cat([torch.from_numpy(shards[r][name]) for r in (0, 1)], 0)
            elif name == "fc2.weight":
                whole = torch.cat([torch.from_numpy(shards[r][name]) for r in (0, 1)], 1)
            else:
                whole = torch.from_numpy(shards[0][name])
                torch.testing.assert_close(torch.from_numpy(shards[1][name]), whole, atol=0, rtol=0)
            torch.testing.assert_close(whole, p, atol=1e-5, rtol=0)


class Tied(nn.Module):
    """x → x·Eᵀ → two blocks → (h·E).mean: the input embedding E is reused by the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = mark_shared_embedding(nn.Parameter(torch.randn(D, D) * 0.3))
        self.blocks = nn.ModuleList(Block(D) for _ in range(2))

    def forward(self, x):
        return (self.blocks[1](self.blocks[0](x @ self.emb.t())) @ self.emb).mean(-1)


class _Stage(nn.Module):
    """One pipeline stage of Tied, holding its own copy of the tied embedding."""

    def __init__(self, full: Tied, first: bool):
        super().__init__()
        self.first, self.block = first, full.blocks[0 if first else 1]
        self.emb = mark_shared_embedding(nn.Parameter(full.emb.detach().clone()))

    def forward(self, x):
        return self.block(x @ self.emb.t()) if self.first else (self.block(x) @ self.emb).mean(-1)


def _split(tied: bool, pp_rank: int):
    """This stage's module, its stage-3 units, and how its parameter names read in the whole model."""
    if tied:
        part = _Stage(Tied(), first=pp_rank == 0)
        return part, [part.block], {"emb": "emb", "block": f"blocks.{pp_rank}"}
    full = make_model()
    parts = (nn.Sequential(full.inp, full.blocks[0], full.blocks[1]), nn.Sequential(full.blocks[2], full.head))
    names = ({"0": "inp", "1": "blocks.0", "2": "blocks.1"}, {"0": "blocks.2", "1": "head"})[pp_rank]
    return parts[pp_rank], [m for m in parts[pp_rank] if m in list(full.blocks)], names


def _dp_pp(stage, tied):
    g = build_groups(Topology(dp=2, pp=2, tp=1))
    part, units, names = _split(tied, g.pp_rank)
    zdp = ZeroDataParallel(
        part,
        ZeroConfig(stage=stage, grad_clip=CLIP),
        dp_group=g.dp,
        optimizer_factory=adamw,
        units=units,
        clip_groups=(g.pp,),
        embedding_group=g.embedding,
    )
    per, micro = BATCH // 2, 2
    mine = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
    losses, norms = [], []
    for x, y in batches(STEPS):
        xs, ys, total = x[mine].chunk(micro), y[mine].chunk(micro), 0.0
        for m in range(micro):  # GPipe-like: each micro-batch forward then backward
            with zdp.no_sync() if m < micro - 1 else torch.enable_grad():
                if g.is_first_stage:
                    act = zdp(xs[m])
                    comm.send(act.detach(), g.next_rank, group=g.pp)
                    grad = torch.empty_like(act)
                    comm.recv(grad, g.next_rank, group=g.pp)
                    act.backward(grad)
                else:
                    act = torch.empty(xs[m].shape[0], D)
                    comm.recv(act, g.prev_rank, group=g.pp)
                    act.requires_grad_(True)
                    loss = nn.functional.mse_loss(zdp(act).reshape(-1), ys[m]) / micro
                    zdp.backward(loss)
                    comm.send(act.grad, g.prev_rank, group=g.pp)
                    total += loss.item()
        norms.append(float(zdp.step()["grad_norm"]))
        losses.append(total)
    params = {}
    for name, p in zdp.full_parameters().items():
        head, _, rest = name.partition(".")
        params[".".join(filter(None, (names[head], rest)))] = p.numpy()
    return g.pp_rank, losses, norms, params


@pytest.mark.parametrize("stage, tied", [(0, False), (1, False), (2, False), (3, False), (0, True), (3, True)])
def test_zero_over_dp_with_two_pipeline_stages_matches_one_process(stage, tied):
    """Tied: the embedding's gradient is summed over both stages and enters the norm once."""
    ref_losses, ref_norms, ref_params = reference_run(steps=STEPS, grad_clip=CLIP, make=Tied if tied else make_model)
    results = run_ranks(_dp_pp, 4, stage, tied)
    # each last-stage DP rank's loss is its half's mean; the two halves average to the reference
    halves = [losses for pp_rank, losses, _, _ in results if pp_rank == 1]
    assert [(a + b) / 2 for a, b in zip(*halves)] == pytest.approx(ref_losses, abs=1e-4)
    for pp_rank, losses, norms, params in results:
        assert norms == pytest.approx(ref_norms, rel=1e-4)
        for name, p in params.items():
            torch.testing.assert_close(torch.from_numpy(p), ref_params[name], atol=1e-5, rtol=0)


F = 4  # SeqParallelToy's tensor-parallel features


class SeqParallelToy(nn.Module):
    """Columns [(x·scale).sum, x·w_1 … x·w_F]: ``scale`` is replicated, ``w`` splits by rows over TP.

    With ``tp``, rank r computes the ``scale`` column on its half of the rows only
    (a sequence-parallel region: ``scale``'s gradient is partial on each TP rank
    and must be summed over TP) and its ``w`` columns on all rows (exact, local).
    """

    def __init__(self, tp_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.scale, self.w = nn.Parameter(torch.randn(D) * 0.3), nn.Parameter(torch.randn(F, D) * 0.3)
        self.tp_group = tp_group
        if tp_group is not None:
            r, n = dist.get_rank(tp_group), comm.group_size(tp_group)
            self.w = mark_tp_sharded(nn.Parameter(self.w.detach()[r * F // n : (r + 1) * F // n].clone()), 0)
            mark_sequence_parallel(self.scale)

    def forward(self, x):
        return torch.cat([(x * self.scale).sum(-1, keepdim=True), x @ self.w.t()], -1)

    def local_loss(self, x, y):
        """This TP rank's share of the dp-slice loss: the TP ranks' shares add up to it."""
        r, n = dist.get_rank(self.tp_group), comm.group_size(self.tp_group)
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        seq = ((x[rows] * self.scale).sum(-1) - y[rows]).pow(2).sum()
        feats = (x @ self.w.t() - y[:, None]).pow(2).sum()
        return (seq + feats) / (len(x) * (F + 1))


def _dp_tp_sequence_parallel(stage):
    g = build_groups(Topology(dp=2, pp=1, tp=2))
    model = SeqParallelToy(g.tp)
    zdp = ZeroDataParallel(
        model, ZeroConfig(stage=stage, grad_clip=CLIP), dp_group=g.dp, optimizer_factory=adamw, tp_group=g.tp
    )  # one default bucket would hold both params: separation matters
    per = BATCH // 2
    norms = []
    for x, y in batches(STEPS):
        zdp.backward(
            model.local_loss(x[g.dp_rank * per : (g.dp_rank + 1) * per], y[g.dp_rank * per : (g.dp_rank + 1) * per])
        )
        norms.append(float(zdp.step()["grad_norm"]))
    return g.tp_rank, norms, {n: p.numpy() for n, p in zdp.full_parameters().items()}


@pytest.mark.parametrize("stage", [0, 2])
def test_sequence_parallel_grads_are_summed_over_tp_and_tp_sharded_ones_are_not(stage):
    _, ref_norms, ref_params = reference_run(steps=STEPS, grad_clip=CLIP, make=SeqParallelToy)
    results = dict((tp, (norms, params)) for tp, norms, params in run_ranks(_dp_tp_sequence_parallel, 4, stage))
    for norms, params in results.values():
        assert norms == pytest.approx(ref_norms, rel=1e-4)
        torch.testing.assert_close(torch.from_numpy(params["scale"]), ref_params["scale"], atol=1e-5, rtol=0)
    whole_w = torch.cat([torch.from_numpy(results[r][1]["w"]) for r in (0, 1)])
    torch.testing.assert_close(whole_w, ref_params["w"], atol=1e-5, rtol=0)


def test_a_marked_parameter_without_its_group_is_refused_with_the_fix():
    with pytest.raises(ZeroConfigError, match=r"'emb' is marked a tied embedding.*embedding_group=groups.embedding"):
        ZeroDataParallel(Tied(), ZeroConfig(stage=0), dp_group=None, optimizer_factory=adamw)
