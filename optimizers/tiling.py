"""How a whole optimizer step is cut into tiles, and the FP32 working views of one tile.

The whole steps (:mod:`popbert.optimizers.steps`) run every op over one tile at a time, so the
working set stays near the cache on CPU (:func:`default_tile_numel`). Half weights and scaled or
half grads are widened into one FP32 buffer per tile; the weights go back through a rounding
function (a :data:`~popbert.optimizers.stochastic_rounding.RoundFn`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from popbert.optimizers.stochastic_rounding import RoundFn

__all__ = ["CPU_TILE_NUMEL", "Tile", "TilePlan", "default_tile_numel", "step_tiles", "tile_plan"]

TilePlan = list[list[tuple[int, int, int]]]
CPU_TILE_NUMEL = 1 << 21


def default_tile_numel(device: torch.device) -> int | None:
    """Tile size for the whole steps (:mod:`popbert.optimizers.steps`) on ``device``.

    On CPU, running every op of the step over tiles of 2M elements (8 MiB per FP32 array)
    keeps the working set near the cache and avoids full-size temporaries: about 2x faster
    than whole-tensor foreach ops for BERT-Base. Smaller tiles fit cache better but multiply
    the parallel regions, which costs on busy or many-core machines. Accelerators take whole
    tensors: fewer, larger kernels.
    """
    return CPU_TILE_NUMEL if torch.device(device).type == "cpu" else None


def tile_plan(
    sizes: Sequence[int], tile_numel: int | None, splittable: Sequence[bool] | None = None
) -> TilePlan:
    """Cut tensors (by element count) into tiles of about ``tile_numel`` elements.

    Each tile is a list of ``(tensor_index, start, stop)`` over the flattened tensors; small
    tensors share a tile, large ones are split unless ``splittable[i]`` is False (then they
    form one piece however large). ``tile_numel=None`` gives one tile of whole tensors.
    """
    if tile_numel is None:
        return [[(i, 0, n) for i, n in enumerate(sizes)]] if sizes else []
    if tile_numel < 1:
        raise ValueError(f"tile_numel must be positive, got {tile_numel}")
    tiles: TilePlan = []
    current: list[tuple[int, int, int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        if splittable is not None and not splittable[i]:
            current.append((i, 0, n))
            filled += n
        else:
            start = 0
            while start < n:
                stop = min(n, start + max(tile_numel - filled, 1))
                current.append((i, start, stop))
                filled += stop - start
                start = stop
                if filled >= tile_numel:
                    tiles.append(current)
                    current, filled = [], 0
                    continue
        if filled >= tile_numel:
            tiles.append(current)
            current, filled = [], 0
    if current:
        tiles.append(current)
    return tiles


def _take(tensors: Sequence[Tensor], tile: list[tuple[int, int, int]]) -> list[Tensor]:
    pieces = []
    for i, start, stop in tile:
        t = tensors[i]
        pieces.append(t if start == 0 and stop == t.numel() else t.view(-1)[start:stop])
    return pieces


def _fp32_copy(pieces: list[Tensor], scale: float = 1.0) -> tuple[Tensor, list[Tensor]]:
    """One flat FP32 buffer holding ``pieces * scale``, and views of it shaped like them."""
    sizes = [t.numel() for t in pieces]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=pieces[0].device)
    views = [c.view(t.shape) for c, t in zip(flat.split(sizes), pieces, strict=True)]
    torch._foreach_copy_(views, pieces)
    if scale != 1.0:
        flat.mul_(scale)
    return flat, views


class Tile:
    """FP32 working views of one tile: weights (copied if half), grads (copied if scaled)."""

    def __init__(
        self,
        tile: list[tuple[int, int, int]],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        steps: Sequence[int],
    ) -> None:
        self.tile = tile
        self.index = [i for i, _, _ in tile]
        self.steps = [steps[i] for i in self.index]
        self.params = _take(params, tile)
        self.exp_avgs = _take(exp_avgs, tile)
        self.exp_avg_sqs = _take(exp_avg_sqs, tile)
        self._grads = _take(grads, tile)
        self._flat: Tensor | None = None
        self._views: list[Tensor] = []

    def grads(self, grad_factor: float) -> list[Tensor]:
        if grad_factor == 1.0 and all(g.dtype == torch.float32 for g in self._grads):
            return self._grads
        return _fp32_copy(self._grads, grad_factor)[1]

    def weights(self) -> list[Tensor]:
        if self.params[0].dtype == torch.float32:
            return self.params
        self._flat, self._views = _fp32_copy(self.params)
        return self._views

    def store(self, round_fn: RoundFn | None) -> None:
        """Write FP32 working weights back into half parameters (round to nearest without
        ``round_fn``), telling the rounding where each element belongs."""
        if self._flat is None:
            return
        if round_fn is None:
            torch._foreach_copy_(self.params, self._views)
        else:
            round_fn(self._flat, self.params, [(i, start) for i, start, _ in self.tile])
        self._flat, self._views = None, []


def step_tiles(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    tile_numel: int | None,
) -> TilePlan:
    """The tiles of one step's lists: tensors whose lists are not all contiguous stay whole."""
    if len({p.dtype for p in params}) > 1:
        raise ValueError("one call takes parameters of one dtype")
    splittable = [
        all(t.is_contiguous() for t in group)
        for group in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ]
    return tile_plan([p.numel() for p in params], tile_numel, splittable)
