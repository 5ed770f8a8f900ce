"""`execution.compile` everywhere: the compiled session trains like the eager one and does not
recompile once warmed up.

The matrix (plain, packed rows, half weights with stochastic rounding, recompute, pipeline
stages, gradient accumulation) runs `torch.compile` with the `aot_eager` backend: TorchDynamo's
capture, guards and recompilation plus AOTAutograd's joint forward/backward graph — everything
that decides whether compilation works here — without Inductor's C++ code generation, which
costs a minute per graph on 2 cores. One test runs the default Inductor backend end to end.
Tolerance: FP32 1e-5 relative on losses (compiled graphs may reorder reductions).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)

from popbert.builders.bert import build_bert
from popbert.data.packing import pack_instance_arrays
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

STEPS = 4


def adamw(named):
    return AdamW(param_groups_by_name(named, 0.01), lr=2e-3, seed=0)


def unique_graphs() -> int:
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def train(config, batches, **options) -> tuple[list[float], list[int]]:
    """Losses per step and the count of graphs compiled so far after each step."""
    torch.manual_seed(0)
    session = TrainingSession(build_bert(config, seed=3).model(), "loss", adamw,
                              SessionOptions(**options))
    losses, graphs = [], []
    for batch in batches:
        losses.append(float(session.run(batch)["loss"].mean()))
        graphs.append(unique_graphs())
    return losses, graphs


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.compile popbert makes uses the aot_eager backend, from a clean cache."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    monkeypatch.setattr(torch, "compile",
                        functools.partial(torch.compile, backend="aot_eager"))
    yield
    torch._dynamo.reset()


def packed_batches(config, count: int) -> list[dict[str, np.ndarray]]:
    plain = padded_batch(config, 12 * count, seed=5)
    packed, _ = pack_instance_arrays(plain, max_sequences_per_pack=3,
                                     max_predictions_per_pack=config.max_predictions_per_seq)
    rows = packed["input_ids"].shape[0] // count
    return [{k: v[i * rows:(i + 1) * rows].astype(np.int64) for k, v in packed.items()}
            for i in range(count)]


CASES = {
    "plain": (dict(), dict()),
    "dropout": (dict(hidden_dropout=0.1, attention_dropout=0.1), dict()),
    "accumulation": (dict(), dict(gradient_accumulation=2)),
    "bf16 weights, stochastic rounding": (dict(), dict(weight_dtype="bfloat16")),
    "recompute": (dict(num_layers=2, layers_per_ipu=[2], recompute=True), dict(recompute=True)),
    "pipeline": (dict(num_layers=2, layers_per_ipu=[1, 1]),
                 dict(pipeline=True, gradient_accumulation=2)),
    "packed": (dict(packed=True, max_sequences_per_pack=3, max_predictions_per_seq=12), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_session_trains_like_eager_without_recompiling(case: str, aot_eager) -> None:
    model, options = CASES[case]
    config = small_config(**model)
    if config.packed:
        batches = packed_batches(config, STEPS)
    else:
        batches = [padded_batch(config, 8, seed=step) for step in range(STEPS)]
    eager, _ = train(config, batches, **options)
    compiled, graphs = train(config, batches, compile=True, **options)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
    assert graphs[0] > 0, "nothing was compiled"
    # Step 1 may compile once more (a symbolic batch after the first shapes); then none.
    assert graphs[-1] == graphs[1], f"recompiled after step 2: graphs per step {graphs}"


def test_inductor_compiled_step_equals_eager() -> None:
    """The default backend, end to end, on the smallest graph."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    config = small_config(num_layers=1, hidden_size=32, intermediate_size=64,
                          sequence_length=16, max_position_embeddings=16,
                          max_predictions_per_seq=3)
    batches = [padded_batch(config, 4, seed=step) for step in range(3)]
    eager, _ = train(config, batches)
    compiled, graphs = train(config, batches, compile=True)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
    assert graphs[-1] == graphs[1]
    torch._dynamo.reset()
