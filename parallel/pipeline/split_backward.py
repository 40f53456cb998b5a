"""A stage's backward in two halves: the input gradient now (B), the weight gradients later (W).

Zero-bubble schedules (:func:`.schedules.zb_h1`) send the gradient w.r.t. a stage's
input upstream as soon as it is known and compute the weight gradients when the
stage would otherwise idle. :func:`backward_input` runs the part of autograd's graph
that leads from the stage output to its input; on the way it records the gradient
arriving at each node that also leads to a parameter (its *frontier*), and the
graph is retained. :func:`backward_weight` later restarts autograd at those nodes
with the recorded gradients and asks for the parameters only, so each node runs
once for its input-side outputs and once for its parameter-side ones — a linear
layer's ``dX = dY·W`` in B, its ``dW = dYᵀ·X`` in W, nothing computed twice
(autograd computes only the outputs a call needs). A node that computes every output
whatever autograd needs (an ``autograd.Function``: a ``torch.compile``'d block, a fused
sequence-parallel matmul) hands its weight-side gradients over in B; they are kept, and W starts
below that node from them instead of running it again.

Between B and W a micro-batch keeps only what W reads (Qi et al., Table 1): the
forward runs under a :class:`SavedTensorStash`, and after B every saved tensor no
W node reads (softmax probabilities, activation-function outputs, the logits of
the loss ...) is released; a matmul's input, which ``dW`` needs, stays.

W accumulates into ``.grad`` through the parameters' own ``AccumulateGrad`` nodes, in
one autograd run, so post-accumulate-grad hooks (ZeRO's buckets) see each parameter's
gradient once per micro-batch, and a callback queued during W runs once, when W ends,
as after an ordinary backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class _Held:
    __slots__ = ("value", "readers")

    def __init__(self, value):
        self.value, self.readers = value, 0


class SavedTensorStash:
    """Saved-tensor hooks for one forward whose backward :func:`backward_input` splits: they
    let B release what W does not read, each tensor as soon as B has run the last node that reads
    it, as an ordinary backward frees a node's saved tensors after running it (B retains the graph
    for W, which alone would keep them all until B ends). Hooks already active (e.g. a memory meter)
    still see every tensor: they run inside these."""

    def __init__(self):
        self._held: list[_Held] = []
        self._seen: list[_Held] | None = None  # while scanning: the entries unpacked
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(self._outer[0](t) if self._outer else t)
        self._held.append(held)
        return held

    def _unpack(self, held: _Held) -> torch.Tensor:
        if held.value is None:
            raise RuntimeError("a zero-bubble W read a saved tensor its B released (split_backward's bookkeeping)")
        if self._seen is not None:
            self._seen.append(held)
        return self._outer[1](held.value) if self._outer else held.value

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run the forward in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def scan(self, nodes: Iterable[Node]) -> dict[Node, list[_Held]]:
        """Each node's entries (read before B runs it: its backward may modify them in place), each
        entry counting the nodes that read it (an activation-checkpointed block's inputs: all of its
        nodes)."""
        out = {}
        for node in nodes:
            self._seen = seen = []
            try:
                _touch_saved(node)
            finally:
                self._seen = None
            out[node] = entries = list({id(h): h for h in seen}.values())
            for held in entries:
                held.readers += 1
        return out

    @staticmethod
    def done(entries: list[_Held]) -> None:
        """A node that read ``entries`` has run for the last time: release those no other node reads."""
        for held in entries:
            held.readers -= 1
            if held.readers == 0:
                held.value = None

    def release_except(self, kept: Iterable[_Held]) -> None:
        """Drop every saved tensor but ``kept`` (what the nodes W runs read)."""
        keep = {id(h) for h in kept}
        for held in self._held:
            if id(held) not in keep:
                held.value = None
        self._held = []


@functools.cache
def _saved_names(kind: type) -> tuple[str, ...]:
    """The attributes holding a node type's saved tensors (C++ nodes: ``_saved_*``; an
    ``autograd.Function``'s: ``saved_tensors``), looked up once per type."""
    names = tuple(n for n in dir(kind) if n.startswith("_saved_"))
    return names or (("saved_tensors",) if hasattr(kind, "saved_tensors") else ())


def _touch_saved(node: Node) -> None:
    """Unpack every tensor ``node`` saved."""
    for name in _saved_names(type(node)):
        getattr(node, name)


@dataclass
class WeightGradWork:
    """What :func:`backward_input` left for :func:`backward_weight`: per group of parameters
    that share frontier nodes, those nodes and the gradients recorded at them."""

    groups: list[tuple[list[torch.Tensor], list[Node]]] = field(default_factory=list)
    recorded: dict[Node, tuple] = field(default_factory=dict)
    # frontier nodes that computed their weight-side gradients in B anyway: [(edge below, gradient)]
    computed: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)  # keep the graph alive until W


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root`` → the nodes whose backward feeds it (its consumers)."""
    parents: dict[Node, list[Node]] = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(start: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node from which autograd reaches it."""
    seen, stack = {start}, [start]
    while stack:
        for p in parents[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _frontier(
    param_node: Node, on_input_path: set[Node], parents: dict[Node, list[Node]]
) -> tuple[set[Node], set[Node]]:
    """The input-path nodes from which ``param_node`` is reached without passing another
    input-path node, and the nodes on those paths (``param_node`` included)."""
    frontier, seen, stack = set(), {param_node}, [param_node]
    while stack:
        for p in parents[stack.pop()]:
            if p in on_input_path:
                frontier.add(p)
            elif p not in seen:
                seen.add(p)
                stack.append(p)
    return frontier, seen


def backward_input(
    output: torch.Tensor,
    grad: torch.Tensor | None,
    inputs: torch.Tensor,
    params: Iterable[torch.Tensor],
    stash: SavedTensorStash | None = None,
) -> tuple[torch.Tensor | None, WeightGradWork | None]:
    """B: the gradient of ``output`` (seeded with ``grad``; ``None`` for a scalar loss) w.r.t.
    ``inputs`` (a leaf that requires grad), accumulating nothing into ``params``. With the
    ``stash`` the forward ran under, the saved tensors W will not read are released.

    Returns ``(d inputs, work)``; ``work`` is for :func:`backward_weight`. Where the output
    does not depend on ``inputs`` there is nothing to split: this runs the whole backward
    (parameters' gradients accumulated) and returns ``(None, None)``.
    """
    if output.grad_fn is None:
        raise ValueError("backward_input: the output has no autograd graph (computed under no_grad?)")
    parents = _parents(output.grad_fn)
    input_node = get_gradient_edge(inputs).node
    if input_node not in parents:
        torch.autograd.backward(output, grad)
        return None, None
    on_input_path = _ancestors(input_node, parents)
    param_list = [p for p in params if p.requires_grad]
    by_node = {get_gradient_edge(p).node: p for p in param_list}
    # group parameters whose frontiers overlap: one autograd call per group runs each node once
    groups: list[tuple[list[torch.Tensor], set[Node]]] = []
    w_nodes: set[Node] = set()  # what W runs: frontier nodes and the parameter-side nodes below them
    for node, p in by_node.items():
        if node not in parents:
            continue  # not used by this stage's output: no gradient, as in a plain backward
        frontier, side = _frontier(node, on_input_path, parents)
        w_nodes |= frontier | side
        joined = [g for g in groups if g[1] & frontier]
        groups = [g for g in groups if not g[1] & frontier]
        groups.append(([p, *(q for g in joined for q in g[0])], frontier.union(*(g[1] for g in joined))))
    # a group with several frontier nodes may run input-path nodes between them in W: keep all then
    releasable = stash is not None and all(len(nodes) == 1 for _, nodes in groups)
    work = WeightGradWork(groups=[(ps, list(nodes)) for ps, nodes in groups], outputs=[output])
    handles: list = []
    try:
        _hook_b(work, groups, parents, on_input_path, w_nodes, stash if releasable else None, handles)
        (dx,) = torch.autograd.grad(output, inputs, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, work


def _hook_b(work, groups, parents, on_input_path, w_nodes, stash, handles: list) -> None:
    """B's hooks (appended to ``handles``): record the gradient arriving at each frontier node; keep
    what a frontier node alone in its group computes for its weights anyway (:func:`_keep_computed`);
    with a ``stash``, release each saved tensor once the last node of B that reads it has run, except
    those W reads, and after B whatever W will not read."""
    for node in {n for _, nodes in groups for n in nodes}:
        handles.append(node.register_prehook(lambda grads, node=node: work.recorded.__setitem__(node, grads)))
    saved = stash.scan(parents) if stash is not None else {}
    if stash is not None:
        for node in parents.keys() - w_nodes:  # B runs it once (W never): its readers' count goes down
            handles.append(node.register_hook(lambda _gi, _go, entries=saved[node]: SavedTensorStash.done(entries)))
    # a node alone at its group's frontier: W restarting below it cannot reach another frontier node
    # (with several, W runs input-path nodes between them and each frontier node must run there)
    for node in (next(iter(nodes)) for _, nodes in groups if len(nodes) == 1):
        entries = saved.get(node, [])
        keep = lambda grads_in, _, node=node, entries=entries: _keep_computed(  # noqa: E731
            work, node, grads_in, on_input_path, w_nodes, entries
        )
        handles.append(node.register_hook(keep))
    if stash is not None:  # when B ends (this hook list is removed after): W's nodes keep what they read
        handles.append(_AfterB(stash, saved, w_nodes, work))


class _AfterB:
    """A handle whose ``remove()`` (after B, with the hooks) releases what W will not read."""

    def __init__(self, stash: SavedTensorStash, saved: dict, w_nodes: set, work: WeightGradWork):
        self.stash, self.saved, self.w_nodes, self.work = stash, saved, w_nodes, work

    def remove(self) -> None:
        runs_in_w = self.w_nodes - self.work.computed.keys()
        self.stash.release_except(h for n in runs_in_w for h in self.saved.get(n, ()))


def _keep_computed(
    work: WeightGradWork,
    node: Node,
    grads_in: tuple,
    on_input_path: set[Node],
    w_nodes: set[Node],
    saved: list[_Held],
) -> None:
    """B's post-hook on a frontier node: keep the weight-side gradients it computed although only its
    input side was asked for (all of them, or none: then the node runs again in W). Nothing else it
    gave is held (its input-side gradient flows on and is freed as usual); W will not run it, so the
    gradient recorded at it and what it ``saved`` are dropped now, not when B ends."""
    below = [
        (GradientEdge(child, nr), g)
        for (child, nr), g in zip(node.next_functions, grads_in)
        if child is not None and child not in on_input_path and child in w_nodes
    ]
    if below and all(g is not None for _, g in below):
        work.computed[node] = below
        work.recorded.pop(node, None)
        SavedTensorStash.done(saved)  # W will not run it: what only it reads goes now


def backward_weight(work: WeightGradWork) -> None:
    """W: accumulate the weight gradients :func:`backward_input` deferred into ``.grad``.

    Each group's gradients are computed (``autograd.grad``, nothing accumulated; the gradients
    recorded for the group are dropped as soon as it is done), then one autograd run hands them
    all to the parameters' ``AccumulateGrad`` nodes through views that cost nothing: every
    post-accumulate-grad hook runs once, and a callback queued during W (ZeRO's end of backward)
    once, when all of W is in — as after one backward. The stage's weight gradients are therefore
    all alive at once for a moment (autograd would accumulate them one by one). The graph is
    released after.
    """
    params_out, grads_out = [], []
    for params, nodes in work.groups:
        for p, dw in _group_weight_grads(work, params, nodes):
            params_out.append(p)
            grads_out.append(dw)
    work.groups, work.recorded, work.computed, work.outputs = [], {}, {}, []
    if params_out:
        torch.autograd.backward([p.view_as(p) for p in params_out], grads_out, inputs=params_out)


def _group_weight_grads(
    work: WeightGradWork, params: list[torch.Tensor], nodes: list[Node]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One group's ``(parameter, weight gradient)`` pairs, from the gradients B recorded or computed at
    its frontier ``nodes``, which are taken out of ``work`` (no other group reads them)."""
    edges, grads, pin = [], [], []
    for node in nodes:
        for edge, g in work.computed.pop(node, ()):  # computed in B: start below the node
            edges.append(edge)
            grads.append(g)
        recorded = work.recorded.pop(node, None)
        if recorded is None:
            continue  # computed in B, or no gradient reached it (a branch the output does not use)
        for i, g in enumerate(recorded):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
        if len(nodes) > 1:  # one frontier node may also feed another: keep the recorded value
            pin.append(node.register_prehook(lambda _grads, rec=recorded: rec))
    try:
        if not edges:
            return []
        dws = torch.autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True)
        return [(p, dw) for p, dw in zip(params, dws) if dw is not None]
    finally:
        for h in pin:
            h.remove()
