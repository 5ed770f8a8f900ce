"""Pipelining: the graph split at its `__pipeline_stage` annotations and scheduled (CPU, FP32).

Stages of the small BERT: `layers_per_ipu=[2]` gives 2 stages (embeddings + both layers on
device 0 | heads, back on device 0); `[0, 1, 1]` gives 4 (embeddings | layer 0 | layer 1 |
heads) on 3 devices, the heads sharing device 0 with the tied word embedding. Pipelined training
must give the loss and weights of the unpipelined graph; only the order in which the tied
embedding's two gradient contributions are added differs (last bits).
"""

from __future__ import annotations

import pytest
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)
from memory_helpers import PeakMemory

from popbert.builders.bert import build_bert
from popbert.optimizers import Lamb, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.partition import Program
from popbert.runtime.schedules import schedule_order, stage_actions
from popbert.runtime.session import InferenceSession, TrainingSession

STEPS, ACCUMULATION, MICRO = 3, 4, 2


def lamb(named):
    return Lamb(param_groups_by_name(named, 0.01), lr=2e-3, seed=0, max_grad_norm=1.0)


def train(config, **options) -> tuple[dict[str, torch.Tensor], torch.Tensor, TrainingSession]:
    torch.manual_seed(0)
    session = TrainingSession(build_bert(config, seed=3).model(), "loss", lamb,
                              SessionOptions(gradient_accumulation=ACCUMULATION, **options))
    losses = [session.run(padded_batch(config, MICRO * ACCUMULATION, seed=step))["loss"]
              for step in range(STEPS)]
    return session.weights(), torch.cat(losses), session


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Worst per-tensor max|a - b| / max|b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.fixture(scope="module")
def reference() -> dict:
    results = {}
    for layers in ([2], [0, 1, 1]):
        config = small_config(layers_per_ipu=layers)
        weights, losses, _ = train(config)
        results[tuple(layers)] = (config, weights, losses)
    return results


@pytest.mark.parametrize("layers,stages", [([2], 2), ([0, 1, 1], 4)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_training_matches_unpipelined(reference, layers, stages, schedule) -> None:
    config, expected_weights, expected_losses = reference[tuple(layers)]
    weights, losses, session = train(config, pipeline=True, pipeline_schedule=schedule)
    assert session.program.num_stages == stages
    assert session.engine is not None and session.engine.schedule == schedule
    torch.testing.assert_close(losses, expected_losses, rtol=1e-6, atol=0)
    error = relative(weights, expected_weights)
    print(f"{stages} stages, {schedule}: weights within {error:.1e}")
    assert 0 <= error <= 1e-5
    # The weights did train: far further than the tolerance.
    initial = InferenceSession(build_bert(config, seed=3).model()).weights()
    assert relative(weights, initial) > 1e-3


def test_threaded_executor_matches_the_sequential_one(reference) -> None:
    """One worker thread per device (what runs on several GPUs), exercised on CPU."""
    config, expected_weights, expected_losses = reference[(0, 1, 1)]
    sequential, seq_losses, _ = train(config, pipeline=True)
    threaded, losses, session = train(config, pipeline=True, pipeline_threads=True)
    assert session.engine.threads
    torch.testing.assert_close(losses, seq_losses, rtol=0, atol=0)
    for name in sequential:
        torch.testing.assert_close(threaded[name], sequential[name], rtol=0, atol=0)


def test_stages_follow_the_annotations_and_the_tied_weight_stays_one_tensor() -> None:
    config = small_config(layers_per_ipu=[0, 1, 1])
    devices = ["cpu", "meta", "meta"]  # any distinct devices: placement only, nothing runs
    session_module = InferenceSession(build_bert(config).model()).module
    program = Program(session_module, pipeline=True, recompute=False, device="cpu",
                      device_of_ipu=lambda ipu: torch.device(devices[ipu]))
    assert program.stages == [0, 1, 2, 3]
    assert program.ipu_of_stage == {0: 0, 1: 1, 2: 2, 3: 0}  # the heads back on device 0
    assert program.producers == {0: set(), 1: {0}, 2: {0, 1}, 3: {2}}  # layers read the mask
    # The word embedding is read by stage 0 (gather) and stage 3 (tied projection): one
    # parameter, on device 0; every other weight on its stage's device.
    assert program.param_devices["Embedding/Embedding_Dict"] == torch.device("cpu")
    assert program.param_devices["Layer0/Attention/QKV/W"] == torch.device("meta")
    params = dict(session_module.named_parameters())
    assert sum(1 for n in params if "Embedding_Dict" in n) == 1


def test_a_weight_shared_across_devices_is_refused() -> None:
    config = small_config(layers_per_ipu=[0, 1, 1])
    module = InferenceSession(build_bert(config).model()).module
    for node in module.graph.nodes:  # move the heads (stage 3) off device 0
        attributes = (node.meta.get("onnx") or {}).get("attributes", {})
        if attributes.get("__pipeline_stage") == 3:
            attributes["__ipu_number"] = 1
    with pytest.raises(ValueError, match="Embedding_Dict.*one device"):
        Program(module, pipeline=True, recompute=False, device="cpu",
                device_of_ipu=lambda ipu: torch.device("cpu" if ipu == 0 else "meta"))


def test_pipelining_needs_stage_annotations() -> None:
    module = InferenceSession(build_bert(small_config()).model()).module
    with pytest.raises(ValueError, match="__pipeline_stage"):
        Program(module, pipeline=True, recompute=False, device="cpu")


def test_pipelined_inference_gives_the_same_outputs() -> None:
    config = small_config(layers_per_ipu=[0, 1, 1])
    model = build_bert(config, seed=5).model()
    batch = padded_batch(config, 3, seed=9)
    plain = InferenceSession(model).run(batch)
    piped = InferenceSession(model, SessionOptions(pipeline=True)).run(batch)
    for name in plain:
        torch.testing.assert_close(piped[name], plain[name], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 2), (5, 16)])
def test_schedules_are_complete_ordered_and_bounded(schedule, stages, micro) -> None:
    chain = {s: ({s - 1} if s else set()) for s in range(stages)}
    after = {s: ({s + 1} if s < stages - 1 else set()) for s in range(stages)}
    order = schedule_order(schedule, stages, chain, after, micro)
    assert sorted(order) == sorted((k, s, m) for k in "FB" for s in range(stages)
                                   for m in range(micro))
    seen = set()
    for kind, stage, m in order:
        if kind == "F" and stage:
            assert ("F", stage - 1, m) in seen
        if kind == "B":
            assert ("F", stage, m) in seen
            if stage < stages - 1:
                assert ("B", stage + 1, m) in seen
        seen.add((kind, stage, m))
    for stage in range(stages):
        actions = stage_actions(schedule, stage, stages, micro)
        backward = [m for kind, _, m in actions if kind == "B"]
        assert backward == sorted(backward)  # gradients accumulate in micro-batch order
        in_flight = peak = 0
        for kind, _, _ in actions:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == (micro if schedule == "gpipe" else min(stages - stage, micro))


def test_one_f_one_b_holds_fewer_activations_than_gpipe() -> None:
    config = small_config(layers_per_ipu=[0, 1, 1], sequence_length=64,
                          max_position_embeddings=64)
    batch = padded_batch(config, 16, seed=1)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        session = TrainingSession(build_bert(config).model(), "loss", lamb,
                                  SessionOptions(gradient_accumulation=8, pipeline=True,
                                                 pipeline_schedule=schedule))
        session.run(batch)  # optimizer state exists before measuring
        with PeakMemory() as memory:
            session.run(batch)
        peaks[schedule] = memory.peak_bytes
    print(f"peak memory of a step, 4 stages x 8 micro-batches: GPipe "
          f"{peaks['gpipe'] / 1e6:.1f} MB, 1F1B {peaks['1f1b'] / 1e6:.1f} MB")
    assert peaks["1f1b"] < 0.75 * peaks["gpipe"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_accumulating_more_micro_batches_keeps_no_more_logits(pipeline: bool) -> None:
    """Only the scalar outputs outlive a micro-batch: with 1F1B (at most `stages` = 4 in flight)
    or without a pipeline, a step over 16 micro-batches peaks no higher than one over 4 (the
    [batch, positions, vocab] MLM logits of finished micro-batches are not kept to the end:
    before that fix the pipelined peak grew by one logits tensor per micro-batch, +40% here)."""
    config = small_config(layers_per_ipu=[0, 1, 1], sequence_length=64,
                          max_position_embeddings=64, vocab_size=4096)
    peaks = {}
    for accumulation in (4, 16):
        torch.manual_seed(0)
        session = TrainingSession(build_bert(config).model(), "loss", lamb,
                                  SessionOptions(gradient_accumulation=accumulation,
                                                 pipeline=pipeline))
        batch = padded_batch(config, 2 * accumulation, seed=1)
        session.run(batch)  # optimizer state exists before measuring
        with PeakMemory() as memory:
            session.run(batch)
        peaks[accumulation] = memory.peak_bytes
    assert peaks[16] < 1.05 * peaks[4], peaks


def test_schedule_name_is_checked() -> None:
    with pytest.raises(ValueError, match="pipeline_schedule"):
        SessionOptions(pipeline_schedule="zigzag")
