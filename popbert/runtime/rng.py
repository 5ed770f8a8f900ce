"""Random-number state of a training process: captured with a checkpoint, restored on resume.

Dropout draws from torch's global generators, so a resumed run reproduces the masks of an
uninterrupted one only if those generators continue where they stopped. NumPy's and Python's
global generators are captured too, for code that draws from them between steps. The states
are plain tensors, numbers and tuples: ``torch.load(weights_only=True)`` reads them back.

Under data-parallel replicas every replica draws its own masks: a checkpoint keeps every
replica's states (:func:`replica_rng`) and each replica restores its own.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["capture_rng", "replica_rng", "restore_rng", "seed_all"]


def seed_all(seed: int) -> None:
    """Seed torch's, NumPy's and Python's global generators from one seed (as
    `transformers.set_seed` does), so that everything `capture_rng` saves is a function of the
    run's seed and its steps: equal runs write equal `rng.pt` files, byte for byte."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and, once initialised, every CUDA device),
    NumPy's and Python's global generators."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy_state = np.random.get_state(legacy=False)
    state["numpy"] = {"bit_generator": numpy_state["bit_generator"],
                      "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                      "pos": int(numpy_state["state"]["pos"]),
                      "has_gauss": int(numpy_state["has_gauss"]),
                      "gauss": float(numpy_state["gauss"])}
    state["python"] = random.getstate()
    return state


def replica_rng(own: Mapping[str, Any], every: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The RNG entry of a data-parallel checkpoint: replica 0's states at the top level (what
    a 1-process resume restores) and every replica's under ``replicas``."""
    return {**own, **every[0], "replicas": [dict(s) for s in every]}


def restore_rng(state: Mapping[str, Any], replica: int = 0) -> None:
    """Restore the RNG states replica ``replica`` saved; a replica the checkpoint did not have
    (resuming on more replicas) keeps its fresh seed. States a checkpoint lacks (older ones hold
    only torch's) are left as they are."""
    replicas = state.get("replicas")
    if replicas is not None:
        if replica >= len(replicas):
            log.info("replica %d has no RNG state in the checkpoint (it had %d replicas): "
                     "its dropout masks start from its seed", replica, len(replicas))
            return
        state = replicas[replica]
    elif replica:
        return
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state({"bit_generator": saved["bit_generator"],
                             "state": {"key": np.asarray(saved["key"]).astype(np.uint32),
                                       "pos": int(saved["pos"])},
                             "has_gauss": int(saved["has_gauss"]),
                             "gauss": float(saved["gauss"])})
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
