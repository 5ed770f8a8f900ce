"""Sessions: state round trips, checked inputs, the device rule, the gradient strategy.

Small BERT graphs on CPU in FP32 (dropout on where the RNG matters). A session resumed from
`state_dict()` must continue bit for bit like the one that kept training.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)

from popbert.builders.bert import build_bert
from popbert.distributed import (
    AllReduceGradients,
    LocalGradients,
    Replicas,
    ShardedGradients,
    ShardedOptimizer,
)
from popbert.errors import CheckpointError, ConfigError, InputError
from popbert.optimizers import Lamb, LossScaler, param_groups_by_name
from popbert.runtime.devices import resolve_device
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession, TrainingSession

CONFIG = small_config(hidden_dropout=0.1, attention_dropout=0.1)
MICRO, ACCUMULATION = 2, 2


@pytest.fixture(scope="module")
def model():
    return build_bert(CONFIG, seed=1).model()


def lamb(named):
    return Lamb(param_groups_by_name(named, 0.01), lr=2e-3, seed=0, max_grad_norm=1.0)


def session(model, scaler: LossScaler | None = None, replicas: Replicas | None = None,
            **options) -> TrainingSession:
    options.setdefault("gradient_accumulation", ACCUMULATION)
    return TrainingSession(model, "loss", lamb, SessionOptions(**options),
                           loss_scaler=scaler, replicas=replicas)


def batch(step: int) -> dict[str, np.ndarray]:
    return padded_batch(CONFIG, MICRO * ACCUMULATION, seed=step)


def train(s: TrainingSession, steps: range) -> torch.Tensor:
    return torch.cat([s.run(batch(step))["loss"] for step in steps])


def through_disk(state: dict) -> dict:
    """What a checkpoint file gives back: torch.save, then the safe loader."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_weights(a: TrainingSession, b: TrainingSession) -> None:
    ours, theirs = a.weights(), b.weights()
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, "dynamic"])
def test_a_resumed_session_continues_bit_for_bit(model, scaling) -> None:
    """Train 3 steps, save, train 2 more == a fresh session loading the saved state, 2 steps
    (dropout on: the RNG state travels with it; a dynamic scale that grows on the way too)."""
    def scaler():
        return LossScaler(2.0**8, growth_interval=2) if scaling else None

    torch.manual_seed(0)
    first = session(model, scaler())
    train(first, range(3))
    state = first.state_dict()
    assert set(state) == {"step", "weights", "optimizer", "loss_scaler", "rng"}
    assert state["step"] == 3
    assert {"torch", "numpy", "python"} <= set(state["rng"])
    expected = train(first, range(3, 5))
    if scaling:
        assert state["loss_scaler"]["scale"] == 2.0**9  # grew after step 2
        assert first.loss_scaler.scale_value == 2.0**10  # and again after step 4
    else:
        assert state["loss_scaler"] == {}

    torch.manual_seed(123)  # another RNG state, undone by load_state_dict
    second = session(model, scaler())
    second.load_state_dict(through_disk(state))
    assert second.step == 3
    resumed = train(second, range(3, 5))
    torch.testing.assert_close(resumed, expected, rtol=0, atol=0)
    assert_same_weights(second, first)
    assert second.step == first.step == 5
    if scaling:
        assert second.loss_scaler.state_dict() == first.loss_scaler.state_dict()

    # The RNG mattered: the same state without its RNG draws other dropout masks.
    third = session(model, scaler())
    third.load_state_dict({**state, "rng": {}})
    assert not torch.equal(train(third, range(3, 5)), expected)


def test_the_state_is_a_snapshot(model) -> None:
    torch.manual_seed(0)
    s = session(model)
    train(s, range(1))
    state = s.state_dict()
    weights = {k: v.clone() for k, v in state["weights"].items()}
    moments = [v["exp_avg"].clone() for v in state["optimizer"]["state"].values()]
    train(s, range(1, 2))
    for name, value in weights.items():
        assert torch.equal(state["weights"][name], value)
    assert all(torch.equal(v["exp_avg"], m)
               for v, m in zip(state["optimizer"]["state"].values(), moments))


def test_numpy_and_python_generators_are_restored(model) -> None:
    s = session(model)
    np.random.seed(5)
    random.seed(5)
    state = s.state_dict()
    expected = (np.random.rand(), random.random())
    np.random.seed(6)
    random.seed(6)
    s.load_state_dict(through_disk(state))
    assert (np.random.rand(), random.random()) == expected


@pytest.mark.parametrize("change,message", [
    (lambda st: st["weights"].pop("Embedding/Embedding_Dict"),
     r"1 of this model's weights missing \(Embedding/Embedding_Dict\)"),
    (lambda st: st["weights"].update({"Extra/W": torch.zeros(2)}),
     r"1 weights this model does not have \(Extra/W\)"),
    (lambda st: st["weights"].update({"Embedding/Embedding_Dict": torch.zeros(7, 64)}),
     r"'Embedding/Embedding_Dict' has shape \(7, 64\), this model \(300, 64\)"),
    (lambda st: st["optimizer"]["param_groups"].pop(),
     "optimizer state does not fit this optimizer"),
    (lambda st: st.pop("optimizer"), "session state lacks optimizer"),
])
def test_a_state_that_does_not_fit_is_one_line(model, change, message) -> None:
    torch.manual_seed(0)
    s = session(model)
    train(s, range(1))
    state = s.state_dict()
    change(state)
    before = {k: v.clone() for k, v in s.weights().items()}
    with pytest.raises(CheckpointError, match=message) as error:
        s.load_state_dict(state)
    assert "\n" not in str(error.value)
    for name, value in before.items():  # nothing was loaded
        assert torch.equal(s.weights()[name], value)


def test_optimizer_moments_of_another_shape_are_refused(model) -> None:
    torch.manual_seed(0)
    s = session(model)
    train(s, range(1))
    state = s.state_dict()
    entry = next(iter(state["optimizer"]["state"].values()))
    entry["exp_avg"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="exp_avg of parameter .* has shape"):
        s.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Checked inputs
# ---------------------------------------------------------------------------------------------


def _inference(model) -> InferenceSession:
    return InferenceSession(model)


@pytest.mark.parametrize("kind", ["inference", "training"])
@pytest.mark.parametrize("edit,message", [
    (lambda b: b.pop("segment_ids"),
     "batch is missing graph input(s) 'segment_ids'; the graph's inputs are input_ids, "
     "segment_ids, input_mask, masked_lm_positions, masked_lm_ids, next_sentence_labels"),
    (lambda b: b.update(input_ids=b["input_ids"][:, :16]),
     "input 'input_ids' has shape (4, 16) but the graph takes (batch_size, 32)"),
    (lambda b: b.update(input_mask=b["input_mask"][0]),
     "input 'input_mask' has shape (32,) but the graph takes (batch_size, 32)"),
    (lambda b: b.update(segment_ids=np.concatenate([b["segment_ids"]] * 2)),
     "input 'segment_ids' has 8 as its batch_size (dimension 0, shape (8, 32)) but input "
     "'input_ids' has 4: every input holds the same batch_size"),
    (lambda b: b["input_ids"].__setitem__((1, 3), 300),
     "input 'input_ids' holds 300, outside the vocabulary size 300 (ids 0..299)"),
    (lambda b: b["input_ids"].__setitem__((0, 0), -1),
     "input 'input_ids' holds -1, outside the vocabulary size 300 (ids 0..299)"),
    (lambda b: b["segment_ids"].__setitem__((2, 5), 2),
     "input 'segment_ids' holds 2, outside 0..1 (the 2 rows of 'Embedding/Segment_Dict' it "
     "indexes)"),
])
def test_a_batch_that_does_not_fit_is_one_line(model, kind, edit, message) -> None:
    s = _inference(model) if kind == "inference" else session(model, gradient_accumulation=1)
    bad = padded_batch(CONFIG, 4, seed=0)
    edit(bad)
    with pytest.raises(InputError) as error:
        s.run(bad)
    assert str(error.value) == message
    assert isinstance(error.value, ValueError)


def test_a_training_batch_is_checked_per_micro_batch(model) -> None:
    s = session(model, gradient_accumulation=2, device_iterations=2)
    with pytest.raises(InputError, match=r"input 'input_ids' has 6 rows, which do not divide "
                       r"into 4 micro-batches per run \(device_iterations 2 × "
                       r"gradient_accumulation 2\)"):
        s.run(padded_batch(CONFIG, 6, seed=0))
    assert s.step == 0
    outputs = s.run(padded_batch(CONFIG, 8, seed=0))  # 4 micro-batches of 2: fine
    assert outputs["loss"].shape == (2,) and s.step == 2


def test_inputs_the_graph_does_not_take_are_ignored(model) -> None:
    extra = {**padded_batch(CONFIG, 2, seed=0), "unused": np.zeros(3)}
    assert "mlm_accuracy" in _inference(model).run(extra)


def test_ranges_come_from_the_gathered_tables(model) -> None:
    specs = {spec.name: spec for spec in _inference(model).inputs.specs}
    assert (specs["input_ids"].bound, specs["input_ids"].table) == (300,
                                                                   "Embedding/Embedding_Dict")
    assert specs["segment_ids"].bound == 2
    # Positions index activations and labels feed the loss: no table, no bound.
    assert specs["masked_lm_positions"].bound is None
    assert specs["masked_lm_ids"].bound is None
    assert specs["input_ids"].dims == ("batch_size", 32)


def test_popart_dialect_inputs_take_the_loaders_int64_and_check_their_32_bit_range() -> None:
    """The popart dialect declares UINT32 inputs: the loaders' int64 batch (and one already in
    uint32) runs as given; a negative id is out of range, named, even where no table bounds it."""
    graph = build_bert(small_config(dialect="popart"), seed=0, batch_size=4).model()
    s = InferenceSession(graph)
    batch = padded_batch(CONFIG, 4, seed=0)
    expected = s.run(batch)["mlm_logits"]
    as_uint32 = {k: v.astype(np.uint32) for k, v in batch.items()}
    torch.testing.assert_close(s.run(as_uint32)["mlm_logits"], expected, atol=0, rtol=0)
    batch["masked_lm_ids"][1, 2] = -3
    with pytest.raises(InputError) as error:
        s.run(batch)
    assert str(error.value) == ("input 'masked_lm_ids' holds -3, outside the graph's UINT32 "
                                "range 0..4294967295")
    batch["input_ids"][0, 0] = -1  # a table-bounded input keeps the table's message
    with pytest.raises(InputError, match="input 'input_ids' holds -1, outside the vocabulary"):
        s.run(batch)


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_machine_is_one_line(model, device) -> None:
    for make in (lambda: InferenceSession(model, SessionOptions(device=device)),
                 lambda: session(model, device=device)):
        with pytest.raises(ConfigError) as error:
            make()
        message = str(error.value)
        assert message == (f"execution.device is {device!r} but this machine has no such "
                           "device (available: cpu only, no CUDA device)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_one_device_rule() -> None:
    from popbert.config import load_config

    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="'gpu', which is not a device"):
        resolve_device("gpu")
    assert SessionOptions.from_config(load_config("tiny")).device == "cpu"  # tiny: auto
    with pytest.raises(ConfigError, match="execution.device is 'cuda'"):
        SessionOptions.from_config(load_config("tiny", ["execution.device=cuda"]))


def test_options_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        SessionOptions(weight_dtype="float8")
    with pytest.raises(ValueError, match="gradient_accumulation must be >= 1"):
        SessionOptions(gradient_accumulation=0)


# ---------------------------------------------------------------------------------------------
# The gradient strategy
# ---------------------------------------------------------------------------------------------


@dataclass
class MirrorReplicas(Replicas):
    """Two replicas in one process whose peer always holds the same values: collectives are
    exact without a process group (a sum doubles, a gather repeats)."""

    size: int = 2

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor.mul_(self.size) if op == "sum" else tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj):
        return [obj] * self.size


def test_the_strategy_is_chosen_once_from_the_layout(model) -> None:
    local = session(model)
    assert type(local.gradients) is LocalGradients
    assert local.optimizer is local.gradients.optimizer
    sharded = session(model, replicated_tensor_sharding=True)
    assert type(sharded.gradients) is ShardedGradients
    assert isinstance(sharded.optimizer, ShardedOptimizer)
    mirrored = session(model, replicas=MirrorReplicas(), replication_factor=2)
    assert type(mirrored.gradients) is AllReduceGradients


def test_every_strategy_trains_like_the_local_one(model) -> None:
    """All-reduce over identical replicas is exact; sharding over one replica reorders LAMB's
    norm sums only (last bits)."""
    def trained(**kwargs) -> TrainingSession:
        torch.manual_seed(0)
        s = session(model, **kwargs)
        train(s, range(2))
        return s

    local = trained()
    assert_same_weights(trained(replicas=MirrorReplicas(), replication_factor=2), local)
    sharded = trained(replicated_tensor_sharding=True).weights()
    for name, value in local.weights().items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-7)


def test_a_sharded_state_resumes_unsharded(model) -> None:
    torch.manual_seed(0)
    sharded = session(model, replicated_tensor_sharding=True)
    train(sharded, range(2))
    state = through_disk(sharded.state_dict())
    expected = train(sharded, range(2, 3))
    plain = session(model)
    plain.load_state_dict(state)
    torch.testing.assert_close(train(plain, range(2, 3)), expected, rtol=1e-5, atol=0)


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off(model) -> None:
    """FP16 weights: a huge loss scale overflows their FP16 gradients; the step leaves the
    weights alone, halves the scale and reports it."""
    torch.manual_seed(0)
    scaler = LossScaler(2.0**24, max_scale=2.0**24)
    s = session(model, scaler, weight_dtype="float16", gradient_accumulation=1)
    before = {k: v.clone() for k, v in s.weights().items()}
    outputs = s.run(padded_batch(CONFIG, 2, seed=0))
    assert outputs["loss_scale"].tolist() == [2.0**24]
    assert scaler.skipped_steps == 1 and scaler.scale_value == 2.0**23
    for name, value in before.items():
        assert torch.equal(s.weights()[name], value), name
    assert s.step == 1
