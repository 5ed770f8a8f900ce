"""How close is `popbert plan`'s memory estimate to a real training step's peak? (CPU)

For each model the plan is made from the config alone, then the same config trains on CPU on
the bundled corpus and the peak memory of one training step (after a warm-up step, so the
optimizer state exists) is measured. Every step accumulates gradients over two micro-batches,
as pre-training does (Graphcore's presets accumulate 512 or 1024): the second micro-batch's
activations then meet a full set of gradients, which is the peak the plan predicts.

* **persistent**: the trainable weights and the optimizer state the session holds (summed from
  its tensors; the plan must match them exactly);
* **step**: the peak of memory allocated during the step above that: activations, gradients,
  the optimizer step's workspace. It is measured with a dispatch mode that counts every new
  tensor storage until it is freed, like ``PeakMemory`` (tests/memory_helpers.py), except that a
  view of or an in-place op on a tensor that existed before the step (a weight's transpose, the
  optimizer's in-place moment updates) is not counted as new memory. PeakMemory counts those
  too; its number is printed next to it for comparison.

The plan's step estimate is gradients + max(activations of the micro-batch + FP32 views of half
weights + the previous micro-batch's graph outputs, the optimizer step's workspace), for a CPU
(dropout keeps its noise at the activation width; the optimizer steps 2M-element tiles).

    python benchmarks/plan_accuracy.py              # 6 cases, about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from popbert.config import load_config
from popbert.plan import format_bytes, plan_run
from popbert.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memory_helpers import PeakMemory, optimizer_state_bytes  # noqa: E402

L4_H256 = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
           "model.intermediate_size=1024", "execution.micro_batch_size=16"]
RECOMPUTE = ["model.recompute=true", "execution.recompute=true"]
CASES: dict[str, list[str]] = {
    "tiny L2 H128 A2, batch 32": [],
    "tiny, recompute (1 checkpoint)": ["model.layers_per_ipu=[2]", *RECOMPUTE],
    "L4 H256 A4, batch 16": L4_H256,
    "L4 H256 A4, recompute (3 checkpoints)": [*L4_H256, "model.layers_per_ipu=[4]", *RECOMPUTE],
    "L4 H256 A4, 2-stage pipeline, 1F1B x 4": [*L4_H256, "model.layers_per_ipu=[2,2]",
                                                "execution.pipeline=true",
                                                "execution.gradient_accumulation=4"],
    "tiny, FP16 weights": ["execution.weight_dtype=float16"],
    "tiny, no dropout (fused Attention op)": ["model.hidden_dropout=0",
                                              "model.attention_dropout=0"],
    "tiny, BF16 compute (autocast)": ["execution.compute_dtype=bfloat16"],
    "L4 H256 A4, BF16 weights + compute": [*L4_H256, "execution.weight_dtype=bfloat16",
                                           "execution.compute_dtype=bfloat16"],
}


class NewStorageMemory(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the block and alive at once.

    Storages that existed when the block started (weights, optimizer state) are not new memory
    when an op returns a view of them or updates them in place, so they are skipped by address
    (they stay alive throughout, so their addresses cannot be reused inside the block).
    """

    def __enter__(self) -> NewStorageMemory:
        gc.collect()
        self.before: set[int] = set()
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    self.before.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, ReferenceError):  # tensors without storage (meta, sparse)
                continue
        self.current = self.peak = 0
        self._live: dict[int, int] = {}
        return super().__enter__()

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() in self.before or id(storage) in self._live:
                continue
            self._live[id(storage)] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, id(storage))
        return out


def measure(name: str, overrides: list[str]) -> dict[str, float]:
    """Plan and measure one case; returns the numbers of its table row."""
    cfg = load_config("tiny", ["execution.device=cpu", "execution.gradient_accumulation=2",
                               *overrides])
    plan = plan_run(cfg, config_name=name)
    # A pipeline's devices are all this one CPU: their needs add up.
    estimate_step = sum(d.gradient_bytes + max(d.forward_backward_bytes, d.workspace_bytes)
                        for d in plan.devices)
    planned_persistent = sum(d.weight_bytes + d.optimizer_bytes for d in plan.devices)
    # The run as `popbert pretrain` assembles it (the tiny preset's AdamW), in scratch; each
    # `session.run` takes one step: two micro-batches (more for the pipeline case).
    with tempfile.TemporaryDirectory() as scratch, \
            Trainer.from_config(cfg, Path(scratch) / "run") as trainer:
        session = trainer.session
        batches = trainer.batches()
        session.run(next(batches))  # warm-up: the optimizer state now exists
        persistent = (sum(p.numel() * p.element_size() for _, p in session.named_parameters)
                      + optimizer_state_bytes(session.optimizer))
        session.optimizer.zero_grad(set_to_none=True)
        with NewStorageMemory() as memory:
            session.run(next(batches))
        session.optimizer.zero_grad(set_to_none=True)
        with PeakMemory("cpu") as peak_memory:
            session.run(next(batches))
    return {"estimate_step": estimate_step, "step": memory.peak,
            "peak_memory": peak_memory.peak_bytes,
            "estimate_total": sum(d.total_bytes for d in plan.devices),
            "total": persistent + memory.peak,
            "persistent_match": persistent == planned_persistent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = (f"{'case':40} {'plan: step':>12} {'measured':>12} {'plan/meas':>9} "
              f"{'PeakMemory':>11} {'plan: total':>12} {'measured':>12} {'plan/meas':>9} "
              f"{'state':>6}")
    print(header)
    start = time.perf_counter()
    for name, overrides in CASES.items():
        r = measure(name, overrides)
        print(f"{name:40} {format_bytes(r['estimate_step']):>12} {format_bytes(r['step']):>12} "
              f"{r['estimate_step'] / r['step']:>9.3f} {format_bytes(r['peak_memory']):>11} "
              f"{format_bytes(r['estimate_total']):>12} {format_bytes(r['total']):>12} "
              f"{r['estimate_total'] / r['total']:>9.3f} "
              f"{'exact' if r['persistent_match'] else 'DIFF':>6}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s; step = activations + gradients + optimizer "
          "workspace above the weights and optimizer state; state: the plan's weights + "
          "optimizer state against the session's tensors)")


if __name__ == "__main__":
    main()
