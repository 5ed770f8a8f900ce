"""In-batch negatives across replicas: 2 replicas of 4 rows, each ranking its anchors against
every replica's candidates (`ai.graphcore::ReplicatedAllGather`, `popbert.distributed.gather`),
with gradients mean-reduced as popbert's replicas reduce them, give the loss and the gradients
of one process of 8 rows.

Tolerances: loss 1e-5, gradients 1e-4 of each tensor's largest entry + 1e-7 (float32 sums in
another order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from replica_helpers import rendezvous

sys.path.insert(0, str(Path(__file__).parent.parent))

CASES = {"hard-negatives": dict(texts=3, symmetric=False),
         "symmetric": dict(texts=2, symmetric=True)}


def _graph(case: str):
    from bert_helpers import small_config

    import popbert.tasks  # noqa: F401 (registers the task heads)
    from popbert.builders.bert import build_bert
    from popbert.builders.bert_config import TaskConfig

    settings = CASES[case]
    head = TaskConfig(name="embedding", pooling="mean", scale=20.0, texts=settings["texts"],
                      loss="mnrl", symmetric=settings["symmetric"])
    return build_bert(small_config(task=head), task="embedding", seed=3,
                      dynamic_sequence=True).model()


def _batch(case: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    texts = CASES[case]["texts"]
    ids = rng.integers(5, 300, (8, texts, 16))
    mask = np.ones_like(ids)
    mask[:, :, 12:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}


def _loss_and_grads(case: str, rows: slice) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    from popbert.runtime.session import TrainingSession

    session = TrainingSession(_graph(case), "loss",
                              lambda p: torch.optim.SGD([x for _, x in p], lr=0))
    loss = session.forward({k: v[rows] for k, v in _batch(case).items()})["loss"]
    loss.backward()
    return loss.detach(), {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                           for n, p in session.named_parameters}


def _worker(rank: int, world: int, init_method: str, out: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        loss, grads = _loss_and_grads(case, slice(4 * rank, 4 * rank + 4))
        dist.all_reduce(loss)
        for grad in grads.values():  # the replicas' mean, as popbert reduces gradients
            dist.all_reduce(grad)
            grad /= world
        if rank == 0:
            np.savez(out, loss=(loss / world).numpy(),
                     **{f"grad:{n}": g.numpy() for n, g in grads.items()})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_two_replicas_of_four_are_one_of_eight(case: str, tmp_path: Path) -> None:
    out = tmp_path / "replicas.npz"
    mp.spawn(_worker, args=(2, rendezvous(tmp_path), str(out), case), nprocs=2, join=True)
    theirs = np.load(out)
    loss, grads = _loss_and_grads(case, slice(0, 8))
    assert abs(float(theirs["loss"]) - float(loss)) <= 1e-5
    for name, grad in grads.items():
        expected, got = grad.numpy(), theirs[f"grad:{name}"]
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max() + 1e-7, name
    # Each replica alone (its own 4 rows, no gathering) is a different loss: the test sees it.
    alone, _ = _loss_and_grads(case, slice(0, 4))
    assert abs(float(alone) - float(loss)) > 1e-3
