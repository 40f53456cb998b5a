"""Gradient-accumulation fusion (issue 17): a large linear layer adds its weight gradient straight
into a ``.grad`` marked as a main gradient (ZeRO's flat buffer) in one GEMM, exactly where autograd
would have added it in place, and leaves autograd's semantics alone everywhere else."""

import pytest
import torch
from torch import nn

import parallel.layers.linear as linear_mod
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.params import has_main_grad, mark_main_grad
from parallel.testing import run_ranks


@pytest.fixture
def fuse_all(monkeypatch):
    """Every marked weight takes the fused path (the test layers are below the real threshold)."""
    monkeypatch.setattr(linear_mod, "WGRAD_FUSION_MIN_NUMEL", 0)
    calls = []
    inner = linear_mod._adds_into_grad
    monkeypatch.setattr(linear_mod, "_adds_into_grad", lambda p: calls.append(inner(p)) or calls[-1])
    return calls


def _pair(cls, seed=0):
    torch.manual_seed(seed)
    a = cls(16, 24) if cls is ColumnParallelLinear else cls(24, 16)
    b = cls(16, 24) if cls is ColumnParallelLinear else cls(24, 16)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_fused_accumulation_equals_autograds_in_the_same_grad_tensor(cls, fuse_all):
    fused, plain = _pair(cls)
    for p in fused.parameters():
        p.grad = torch.zeros_like(p)  # a persistent main gradient, as ZeRO's views
        mark_main_grad(p)
    held = fused.weight.grad
    torch.manual_seed(1)
    for _ in range(3):  # micro-batches accumulate
        x = torch.randn(2, 5, fused.weight.shape[1], requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y = fused(x)
        assert type(y.grad_fn).__name__ == "_LinearIntoMainGradBackward"
        (y.square().sum() / 3).backward()
        plain(x2).square().sum().div(3).backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert fused.weight.grad is held  # added into, never replaced
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-6)
    assert fuse_all == [True] * 3


def test_autograd_grad_and_a_backward_for_other_inputs_leave_grad_alone(fuse_all):
    fused, plain = _pair(ColumnParallelLinear)
    mark_main_grad(fused.weight)
    fused.weight.grad = torch.zeros_like(fused.weight)
    x = torch.randn(3, 16, requires_grad=True)
    (gw,) = torch.autograd.grad(fused(x).sum(), [fused.weight])  # hands the gradient back
    (want,) = torch.autograd.grad(plain(x).sum(), [plain.weight])
    torch.testing.assert_close(gw, want)
    fused(x).sum().backward(inputs=[x])  # only the input's gradient is asked for
    assert fused.weight.grad.abs().sum() == 0
    fused(x).sum().backward(inputs=[fused.weight])  # the weight's: accumulated, fused
    torch.testing.assert_close(fused.weight.grad, want)
    assert fuse_all == [True]  # autograd.grad(weight) and backward(inputs=[x]) never ask: no accumulation


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph")
def test_hooks_a_missing_grad_and_create_graph_take_autograds_own_path(fuse_all):
    fused, plain = _pair(ColumnParallelLinear)
    mark_main_grad(fused.weight)
    x = torch.randn(3, 16)
    plain(x).sum().backward()
    fused(x).sum().backward()  # .grad None: autograd creates it
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad)
    seen = []
    handle = fused.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    fused(x).sum().backward()  # a hook (ZeRO's communicating backward) must see the accumulation
    handle.remove()
    torch.testing.assert_close(seen[0], 2 * plain.weight.grad)
    handle = fused.weight.register_hook(lambda g: g * 0)  # a tensor hook rewrites the gradient first
    fused(x).sum().backward()
    handle.remove()
    torch.testing.assert_close(fused.weight.grad, 2 * plain.weight.grad)
    fused(x).square().sum().backward(create_graph=True)  # double backward: out of place, with a graph
    assert fused.weight.grad.grad_fn is not None
    assert fuse_all == [False] * 4


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = ColumnParallelLinear(16, 32), RowParallelLinear(32, 16)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("wrap", ["checkpoint", "reentrant checkpoint", "saved tensor hooks", "autocast"])
def test_checkpointing_saved_tensor_hooks_and_autocast(wrap, fuse_all):
    """Under a saved-tensor hook the saved weight is an alias without the Parameter's ``.grad``: the
    fused backward reaches the Parameter through the graph, so checkpointing and memory meters fuse
    too. Under autocast the layer takes torch's own path (the fused backward would mix dtypes)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    fused, plain = _Two(), _Two()
    plain.load_state_dict(fused.state_dict())
    for p in fused.parameters():
        p.grad = torch.zeros_like(p)
        mark_main_grad(p)
    x = torch.randn(4, 16, requires_grad=True)

    def run(model):
        if wrap == "checkpoint":
            return checkpoint(model, x, use_reentrant=False)
        if wrap == "reentrant checkpoint":
            return checkpoint(model, x, use_reentrant=True)
        if wrap == "saved tensor hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                return model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    for _ in range(2):
        run(fused).float().square().sum().backward()
        run(plain).float().square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert fuse_all == ([] if wrap == "autocast" else [True] * 4)


def _upstream(W, lin, x):
    h = x * 2
    return torch.autograd.grad(lin(torch.tanh(h), W).square().sum(), [h])


def _output_only(W, lin, x):
    h = lin(x, W)
    h.retain_grad()
    h.square().sum().backward(inputs=[h])
    return [h.grad]


def _tied(W, lin, x):  # an embedding tied to the head (the GPT's default): one gradient, two uses
    ids = torch.tensor([[0, 3, 5], [1, 1, 2]])
    lin(torch.nn.functional.embedding(ids, W) + x[:, :1].sum(), W).square().sum().backward()
    return []


def _three_uses_for_the_input(W, lin, x):
    (lin(x, W).sum() + lin(x * 3, W).square().sum() + W.sum()).backward(inputs=[x])
    return [x.grad]


def _retained_then_grad(W, lin, x):
    y = lin(x, W).square().sum()
    y.backward(retain_graph=True)
    y.backward(retain_graph=True)
    return list(torch.autograd.grad(y, [W, x]))


def _not_a_leaf(W, lin, x):
    V = W * 1.0
    mark_main_grad(V)
    lin(x, V).square().sum().backward()
    return []


@pytest.mark.parametrize(
    "case, fused",
    [
        (_upstream, []),
        (_output_only, []),
        (_tied, [True]),
        (_three_uses_for_the_input, []),
        (_retained_then_grad, [True, True]),
        (_not_a_leaf, []),
    ],
)
def test_every_backward_gives_autograds_gradients(case, fused, fuse_all):
    """A first reviewer's and a second reviewer's scenarios: the weight's ``.grad`` and every returned
    gradient equal ``F.linear``'s, fused exactly where autograd would accumulate in place."""
    torch.manual_seed(0)
    W = mark_main_grad(nn.Parameter(torch.randn(6, 4)))
    R = nn.Parameter(W.detach().clone())
    W.grad, R.grad = torch.zeros_like(W), torch.zeros_like(R)
    x = torch.randn(3, 4)
    ours = case(W, linear_mod.linear, x.clone().requires_grad_())
    theirs = case(R, torch.nn.functional.linear, x.clone().requires_grad_())
    torch.testing.assert_close(W.grad, R.grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    assert fuse_all == fused


def test_torch_func_transforms_take_torchs_path():
    layer = ColumnParallelLinear(512, 256)
    mark_main_grad(layer.weight)
    x = torch.randn(3, 512)
    grads = torch.func.vmap(torch.func.grad(lambda v: layer(v).square().sum()))(x)
    assert grads.shape == x.shape


def test_meta_tensors_of_the_dry_run_take_the_fused_path(fuse_all):
    layer = ColumnParallelLinear(32, 16, device="meta")
    mark_main_grad(layer.weight).grad = torch.empty_like(layer.weight)
    x = torch.empty(2, 3, 32, device="meta", requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "_LinearIntoMainGradBackward"
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.device.type == "meta"
    assert fuse_all == [True]


def test_only_marked_large_weights_with_grad_take_the_fused_path():
    layer = ColumnParallelLinear(16, 24)
    x = torch.randn(2, 16)
    assert type(layer(x).grad_fn).__name__ == "AddmmBackward0"  # unmarked
    mark_main_grad(layer.weight)
    assert layer.weight.numel() < linear_mod.WGRAD_FUSION_MIN_NUMEL
    assert type(layer(x).grad_fn).__name__ == "AddmmBackward0"  # below the threshold: torch's own
    big = mark_main_grad(ColumnParallelLinear(512, 256).weight)
    assert big.numel() >= linear_mod.WGRAD_FUSION_MIN_NUMEL
    with torch.no_grad():
        assert linear_mod.linear(torch.randn(2, 512), big).grad_fn is None  # no graph: plain F.linear
    mark_main_grad(layer.weight, False)
    assert not has_main_grad(layer.weight)


# ------------------------------------------------------------ through ZeRO and the step engine
def _train_both(overrides: dict, steps: int = 3):
    """Train the same tiny recipe with gradient-accumulation fusion off, then on (every marked weight)."""
    from recipes.training.trainer import Trainer

    from ...recipes.test_train_e2e import tiny_recipe

    out = {}
    for name, threshold in (("off", 2**62), ("on", 0)):
        linear_mod.WGRAD_FUSION_MIN_NUMEL = threshold
        calls = []
        inner = linear_mod._adds_into_grad
        linear_mod._adds_into_grad = lambda p, inner=inner: calls.append(inner(p)) or calls[-1]
        try:
            trainer = Trainer(tiny_recipe(train__max_steps=steps, **overrides), run_dir=".")
            losses = [trainer.train_step(s)["loss"] for s in range(steps)]
        finally:
            linear_mod._adds_into_grad = inner
        marked = sorted(n for n, p in trainer.engine.model.named_parameters() if has_main_grad(p))
        params = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}
        out[name] = (losses, params, calls.count(True), calls.count(False), marked)
    return out


@pytest.mark.parametrize(
    "ranks, overrides",
    [
        (1, dict(parallel__zero=0)),  # one process: every micro-batch fused
        (2, dict(parallel__dp=2, parallel__zero=0)),  # the last micro-batch's hooks take autograd's path
        (2, dict(parallel__dp=2, parallel__zero=1, parallel__pp=1)),
        (2, dict(parallel__pp=2, parallel__pp_schedule="zb-h1")),  # split backward: unmarked, native
        (1, dict(train__precision="bf16")),  # 16-bit: .grad is not the main gradient: unmarked
    ],
)
def test_training_with_fusion_equals_training_without(ranks, overrides):
    for rank, result in enumerate(run_ranks(_train_both, ranks, overrides, timeout=240)):
        (loss_off, p_off, _, _, _), (loss_on, p_on, fused, unfused, marked) = result["off"], result["on"]
        torch.testing.assert_close(torch.tensor(loss_on), torch.tensor(loss_off), rtol=1e-5, atol=1e-6)
        for n in p_off:
            torch.testing.assert_close(p_on[n], p_off[n], rtol=1e-5, atol=1e-6, msg=n)
        split = overrides.get("parallel__pp_schedule") == "zb-h1" and rank > 0  # stage 0's B is a whole backward
        if split or overrides.get("train__precision") == "bf16":
            assert marked == [] and fused == 0, (rank, marked, fused)
            continue
        assert fused > 0 and any(n.endswith("weight") for n in marked)
        if overrides.get("parallel__dp", 1) > 1:
            assert unfused > 0  # the communicating backward: ZeRO's hooks see every gradient
        else:
            assert unfused == 0


def test_a_parameter_wrapped_again_at_stage_2_loses_the_mark():
    run_ranks(_rewrap, 1, timeout=60)


def _rewrap():
    import torch.distributed as dist

    from parallel.zero import ZeroDataParallel

    model = nn.Sequential(ColumnParallelLinear(8, 8), RowParallelLinear(8, 8))
    adamw = lambda groups: torch.optim.AdamW(groups)  # noqa: E731
    ZeroDataParallel(model, dp_group=dist.group.WORLD, stage=1, optimizer_factory=adamw)
    assert all(has_main_grad(p) for p in model.parameters())
    ZeroDataParallel(model, dp_group=dist.group.WORLD, stage=2, optimizer_factory=adamw)
    assert not any(has_main_grad(p) for p in model.parameters())
