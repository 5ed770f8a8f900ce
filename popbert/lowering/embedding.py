"""Embedding lookups whose CPU backward touches only the rows a batch used.

A dense embedding gradient is a zero-filled copy of the whole table (30,522 × 384 floats for
all-MiniLM-L6-v2, 47 MB) into which the batch's rows are added. A micro-batch run as several
length groups (`popbert.runtime.groups`) pays that fill and one more 47 MB accumulation for
every group: 3% of a MiniLM fine-tuning step on 2 CPU threads. Here a large table's lookup
returns a sparse gradient (the rows and their indices), and a hook on the table turns the first
one of a step into the dense ``.grad`` every optimizer and gradient layout expects; the later
ones are added into it in place. The sum is the same, one fill a step instead of one a group.

Only leaf tables on CPU of at least :data:`SPARSE_MIN_ROWS` rows take this path, and never
inside ``torch.compile`` (AOTAutograd wants dense gradients) or with ``POPBERT_SPARSE_EMBEDDING=0``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SPARSE", "SPARSE_MIN_ROWS", "embedding"]

#: Whether large CPU tables take sparse gradients (``POPBERT_SPARSE_EMBEDDING=0``: dense).
SPARSE = os.environ.get("POPBERT_SPARSE_EMBEDDING", "1") != "0"
#: Tables with fewer rows (positions, token types) keep dense gradients: filling them is cheap.
SPARSE_MIN_ROWS = 4096

_HOOKED = "_popbert_densify_hook"


def _densify(table: Tensor) -> None:
    """After a gradient lands in ``table.grad``: a sparse one (the step's first) becomes dense."""
    grad = table.grad
    if grad is not None and grad.is_sparse:
        table.grad = grad.to_dense()


def _sparse_gradient(table: Tensor) -> bool:
    # is_dynamo_compiling, not is_compiling: the latter is one flag for the whole process, set
    # while any thread compiles, which would change this thread's path (and its sums' order).
    return (SPARSE and table.requires_grad and table.is_leaf and torch.is_grad_enabled()
            and table.device.type == "cpu" and table.dim() == 2
            and table.shape[0] >= SPARSE_MIN_ROWS and not torch.compiler.is_dynamo_compiling())


def embedding(indices: Tensor, table: Tensor) -> Tensor:
    """``table[indices]`` (``torch.nn.functional.embedding``); the gradient of a large CPU table
    is accumulated row by row (module docstring). ``.grad`` is always dense."""
    if not _sparse_gradient(table):
        return F.embedding(indices, table)
    if not getattr(table, _HOOKED, False):
        table.register_post_accumulate_grad_hook(_densify)
        setattr(table, _HOOKED, True)
    return F.embedding(indices, table, sparse=True)
