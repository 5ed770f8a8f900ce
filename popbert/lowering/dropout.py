"""Training-mode dropout whose mask is a hash of (key, element index), for CPU tensors.

torch's CPU dropout draws its mask with ``bernoulli_``: about 6 ns an element on a 2-core AMD
EPYC, sixty times the multiply it feeds, and 12% of a MiniLM fine-tuning step
(``benchmarks/dropout.py``). Here each call draws one 64-bit key from torch's default generator,
so ``torch.manual_seed``, the RNG state a checkpoint keeps and a resumed run behave as before,
and an element is kept when the counter-based hash of the optimizers' stochastic rounding
(:func:`popbert.optimizers.stochastic_rounding.hash_bits`) of ``(key, its index)`` is at least
``p * 2**32``. Forward and backward are one elementwise loop each, compiled with
``torch.compile`` for large tensors (the eager expression gives the same bits), and the
backward recomputes the mask from the key instead of keeping it: no mask in memory.

A compiled session (``execution.compile``) traces the same expression into its graph, so it
draws the masks eager draws. On CUDA, whose generator is fast, and under
``POPBERT_HASHED_DROPOUT=0``, :func:`dropout` is ``torch.nn.functional.dropout``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from popbert.optimizers.stochastic_rounding import (
    COMPILE_MIN_NUMEL,
    COMPILE_OPTIONS,
    compilation_enabled,
    element_counter,
    flat_alias,
    hash_bits,
)

__all__ = ["HASHED", "dropout", "keep_threshold"]

logger = logging.getLogger(__name__)

#: Whether CPU dropout hashes its masks; ``POPBERT_HASHED_DROPOUT=0`` gives torch's
#: ``bernoulli_`` masks (and its random stream) instead.
HASHED = os.environ.get("POPBERT_HASHED_DROPOUT", "1") != "0"
_SIGN_BIT = -(1 << 31)
_compiled = None
_compile_failed = False


def keep_threshold(p: float) -> int:
    """The int32 an element's hash (sign bit flipped) must reach to be kept: ``round(p·2³²)``
    in the unsigned order, so an element is dropped with probability ``p`` to within 2⁻³³."""
    unsigned = min(round(p * (1 << 32)), (1 << 32) - 1)
    return unsigned - (1 << 31)


def _masked_scale(x: Tensor, counter: Tensor, args: Tensor, scale: Tensor) -> Tensor:
    """``x * scale`` where the element's hash reaches the threshold, else 0 (``args`` =
    [key0, key1, threshold]); 1-D. Forward and backward are both this loop."""
    keep = (hash_bits(counter, (args[0], args[1])) ^ _SIGN_BIT) >= args[2]
    return torch.where(keep, x * scale, 0.0)


def _run(x: Tensor, args: Tensor, scale: Tensor) -> Tensor:
    global _compiled, _compile_failed
    flat = flat_alias(x.detach().contiguous())  # not a view: one compiled variant
    counter = element_counter(flat.numel(), flat.device)
    if flat.numel() >= COMPILE_MIN_NUMEL and compilation_enabled() and not _compile_failed:
        if _compiled is None:
            _compiled = torch.compile(_masked_scale, dynamic=True, options=COMPILE_OPTIONS)
        try:
            return _compiled(flat, counter, args, scale).view(x.shape)
        except Exception:  # no C++ compiler...: the eager expression gives the same bits
            logger.warning("compiling the dropout kernel failed; using eager torch (same "
                           "masks, slower)", exc_info=True)
            _compile_failed = True
    return _masked_scale(flat, counter, args, scale).view(x.shape)


class _HashedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, args: Tensor, scale: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(args, scale)
        return _run(x, args, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        args, scale = ctx.saved_tensors
        return _run(grad, args, scale), None, None


def dropout(x: Tensor, p: float) -> Tensor:
    """Training-mode dropout of ``x`` with drop probability ``p`` (kept values scaled by
    ``1 / (1 - p)``), hashed on CPU as the module docstring says; torch's elsewhere."""
    if p == 0.0:
        return x
    if (not HASHED or x.device.type != "cpu" or p >= 1.0 or not x.is_floating_point()
            or x.numel() >= 1 << 31):
        return F.dropout(x, p, True)
    key = torch.randint(-(1 << 31), 1 << 31, (2,), dtype=torch.int32)
    args = torch.cat([key, torch.tensor([keep_threshold(p)], dtype=torch.int32)])
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    if torch.compiler.is_compiling():
        # Traced into the caller's graph: the same masks as eager, fused by Inductor with
        # their neighbours, and autograd through ``where`` keeps the mask for the backward.
        counter = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
        return _masked_scale(x.reshape(-1), counter, args, scale).view(x.shape)
    return _HashedDropout.apply(x, args, scale)
