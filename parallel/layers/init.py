"""Initialisation that does not depend on the parallel layout, shard by shard.

Every parameter is seen as its *global* (unsharded) tensor, viewed as a matrix
``[rows, cols]`` (dim 0 × the rest) and cut into fixed tiles of
``TILE_ROWS × TILE_COLS``. Tile ``(i, j)`` is drawn from its own generator, seeded
by ``(seed, parameter key, i, j)``; a rank draws only the tiles that overlap its
shard and keeps the overlap. So:

* the gathered weights are bit-identical for every tp (and every pipeline split,
  since keys are global parameter names);
* no rank holds more than its shard plus one tile (``TILE_ROWS·TILE_COLS`` fp32
  values, 4 MiB) of scratch, however large the parameter: a 175B model's shard is
  initialised without its full matrices.

Rows at or beyond a parameter's ``vocab_size`` mark (vocabulary padding) are zero.

**Default initialisation at construction.** Every layer of :mod:`parallel.layers`
is initialised when it is built (``reset_parameters``, like ``torch.nn.Linear``),
unless it is built on the ``meta`` device (then nothing is drawn and nothing is
allocated). :func:`reset_default_` keeps ``torch.nn``'s distributions — linear
weights and biases ``U(-1/√in, 1/√in)`` with ``in`` the *global* input features,
embeddings ``N(0, 1)``, norms one/zero — but draws each parameter's global tensor
with the tiles above, from a seed taken from torch's default generator. So
``torch.manual_seed(s)`` before construction gives the same full weights for every
tp (no two TP ranks hold copies of the same rows), and two layers built one after
the other differ. Models re-initialise by name with :func:`init_parameters_`: the key of a
parameter is its name in the *whole model* (``prefix`` + its name in the module given), so a block
initialised alone passes its own prefix (``prefix="blocks.3."``); pieces of one model drawn from the
same keys are refused where they are put together (:func:`check_distinct_init`), never silently alike.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
from torch import nn

from .. import comm
from ..params import drawn_as, expert_shard, init_key, mark_drawn_as, tp_shard_dim, vocab_rows

TILE_ROWS = 256
TILE_COLS = 4096

#: an init rule maps (name, parameter) to ("normal", std) | ("ones",) | ("zeros",)
InitRule = Callable[[str, nn.Parameter], tuple]


def default_init_rule(name: str, param: nn.Parameter, std: float = 0.02) -> tuple:
    """Biases zero, 1-D weights (norms) one, every matrix normal(0, ``std``)."""
    if name.endswith("bias"):
        return ("zeros",)
    if param.dim() == 1:
        return ("ones",)
    return ("normal", std)


def _tile_seed(seed: int, key: str, i: int, j: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{key}|{i}|{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_tensor_shard_(
    shard: torch.Tensor,
    *,
    key: str,
    seed: int,
    std: float | None = None,
    shard_dim: int | None,
    tp_rank: int,
    tp_size: int,
    vocab_size: int | None = None,
    bound: float | None = None,
) -> torch.Tensor:
    """Fill ``shard`` (rank ``tp_rank`` of ``tp_size`` along ``shard_dim``) with normal(0, ``std``),
    or, given ``bound`` instead, uniform(-bound, bound).

    The values are those of the global tensor drawn tile by tile (module docstring).
    Returns ``shard``.
    """
    if (std is None) == (bound is None):
        raise ValueError("init_tensor_shard_ takes exactly one of std (normal) and bound (uniform)")
    if shard_dim not in (None, 0, 1) or (shard_dim == 1 and shard.dim() != 2):
        raise ValueError(
            f"layout-independent init supports sharding on dim 0 or dim 1 of a matrix, "
            f"got shard_dim {shard_dim} for shape {tuple(shard.shape)}"
        )
    local = shard.reshape(shard.shape[0], -1) if shard.dim() > 0 else shard.reshape(1, 1)
    rows, cols = local.shape
    r0 = rows * tp_rank if shard_dim == 0 else 0
    c0 = cols * tp_rank if shard_dim == 1 else 0
    global_cols = cols * tp_size if shard_dim == 1 else cols
    with torch.no_grad():
        for i in range(r0 // TILE_ROWS, math.ceil((r0 + rows) / TILE_ROWS)):
            for j in range(c0 // TILE_COLS, math.ceil((c0 + cols) / TILE_COLS)):
                tile_c = min(TILE_COLS, global_cols - j * TILE_COLS)
                g = torch.Generator().manual_seed(_tile_seed(seed, key, i, j))
                if bound is None:
                    tile = torch.randn(TILE_ROWS, tile_c, generator=g).mul_(std)
                else:
                    tile = torch.rand(TILE_ROWS, tile_c, generator=g).mul_(2 * bound).sub_(bound)
                gr0, gc0 = i * TILE_ROWS, j * TILE_COLS
                lo_r, hi_r = max(gr0, r0), min(gr0 + TILE_ROWS, r0 + rows)
                lo_c, hi_c = max(gc0, c0), min(gc0 + tile_c, c0 + cols)
                local[lo_r - r0 : hi_r - r0, lo_c - c0 : hi_c - c0].copy_(
                    tile[lo_r - gr0 : hi_r - gr0, lo_c - gc0 : hi_c - gc0]
                )
        if vocab_size is not None and shard_dim in (None, 0) and r0 + rows > vocab_size:
            local[max(0, vocab_size - r0) :].zero_()
    if local.data_ptr() != shard.data_ptr():  # reshape copied (non-contiguous shard)
        shard.copy_(local.view_as(shard))
    return shard


def _fill_(param: torch.Tensor, tp_group, key: str, seed: int, *, std=None, bound=None) -> None:
    """Fill ``param`` with its shard of global tensor ``key``: along its TP split, or an MoE expert
    parameter's split over ep along dim 0 (experts are not split over TP); vocabulary padding zero."""
    ep = expert_shard(param)
    if ep is not None:
        dim, rank, ranks = 0, ep[0], ep[1]
    else:
        dim = tp_shard_dim(param)
        rank, ranks = (comm.tp_rank(tp_group), comm.tp_world_size(tp_group)) if dim is not None else (0, 1)
    init_tensor_shard_(
        param.data,
        key=key,
        seed=seed,
        std=std,
        bound=bound,
        shard_dim=dim,
        tp_rank=rank,
        tp_size=ranks,
        vocab_size=vocab_rows(param),
    )


def reset_default_(
    param: nn.Parameter, tp_group=None, *, std: float | None = None, bound: float | None = None
) -> nn.Parameter:
    """The layers' default initialisation (module docstring) of one parameter, in place.

    Draws one seed from torch's default CPU generator, then fills this rank's shard
    (its ``tp_shard_dim`` mark, vocabulary padding zero) with the global tensor's
    values: normal(0, ``std``) or uniform(±``bound``). A ``meta`` parameter is left
    alone and draws nothing. Communicates nothing.
    """
    if param.is_meta:
        return param
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    _fill_(param, tp_group, "default", seed, std=std, bound=bound)
    return param


def init_parameters_(
    module: nn.Module, *, seed: int = 0, tp_group=None, rule: InitRule = default_init_rule, prefix: str = ""
) -> nn.Module:
    """Initialise every parameter of ``module`` in place, independently of the TP layout.

    The seeding key of a parameter is ``prefix`` + its name in ``module`` (or its ``init_key``
    attribute, which a tied copy sets to the original's name): its full name in the model. Give a
    part of a model its prefix (``init_parameters_(blocks[i], prefix=f"blocks.{i}.")``): without it,
    two blocks initialised with one seed draw the same values, which :func:`check_distinct_init`
    (called by :func:`parallel.pieces.chunks_from_pieces`) refuses. ``rule`` sees the full name.
    Each drawn parameter is marked with its ``(seed, key)``. Meta tensors are skipped. Communicates nothing.
    """
    for local, p in module.named_parameters():
        if p.is_meta:
            continue
        name = prefix + local
        how = rule(name, p)
        with torch.no_grad():
            if how[0] == "zeros":
                p.zero_()
            elif how[0] == "ones":
                p.fill_(1.0)
            else:
                key = init_key(p, name)
                _fill_(p, tp_group, key, seed, std=how[1])
                mark_drawn_as(p, seed, key)
    return module


def check_distinct_init(pieces: dict[str, nn.Module]) -> None:
    """Refuse ``pieces`` (name prefix → module) of one model where two different parameters were drawn by
    :func:`init_parameters_` from the same ``(seed, key)``: they hold the same values (blocks initialised one
    by one without ``prefix``). A tied copy (``init_key`` marked) and a parameter shared by two pieces are
    meant to be alike and pass. Reads marks only: no communication, no device read."""
    from .linear import LayerConfigError  # linear imports this module

    seen: dict[tuple[int, str], tuple[int, str]] = {}
    for where, module in pieces.items():
        for local, p in module.named_parameters():
            drawn = drawn_as(p)
            if drawn is None or init_key(p) is not None:
                continue
            first = seen.setdefault(drawn, (id(p), where + local))
            if first[0] != id(p):
                raise LayerConfigError(
                    f"{first[1]} and {where + local} were both initialised from key {drawn[1]!r} with seed "
                    f"{drawn[0]}, so they hold the same values: init_parameters_ keys a parameter on its name "
                    f"inside the module it is given; initialise each piece with its full name, "
                    f"init_parameters_(piece, seed=..., prefix={where!r}) (or the whole model at once)"
                )


def gather_full_tensor(
    param: torch.Tensor, tp_group, *, data: torch.Tensor | None = None, ep_group=None
) -> torch.Tensor:
    """The full tensor of ``param`` (or of ``data`` laid out like it, e.g. its grad).

    Sharded parameters are all-gathered along their ``tp_shard_dim`` on ``tp_group``
    (output = full bytes); an MoE expert's split over ep (:func:`~parallel.params.expert_shard`)
    is then all-gathered along dim 0 on ``ep_group`` (every global expert, in order); vocabulary
    padding rows are cut off. Replicated ones are copied. Every rank of ``tp_group`` (and, for an
    expert, of ``ep_group``) must call it (it is a collective).
    """
    t = (param if data is None else data).detach()
    dim = tp_shard_dim(param)
    full = t.clone() if dim is None else comm.all_gather_along(t, dim, tp_group)
    ep = (expert_shard(param) or (0, 1))[1]
    if ep > 1:
        if comm.tp_world_size(ep_group) != ep:
            from .linear import LayerConfigError  # linear imports this module

            raise LayerConfigError(
                f"{tuple(t.shape)} expert parameter is split over ep={ep}: pass that ep group to gather it "
                f"(got a group of {comm.tp_world_size(ep_group)})"
            )
        full = comm.all_gather_along(full, 0, ep_group)
    if full is t:
        full = t.clone()
    vocab = vocab_rows(param)
    return full[:vocab] if vocab is not None else full
