"""The PopART backend — a CONTRACT TEST, not a run on IPUs.

No Poplar SDK is installed here, so nothing in this file compiles or runs a graph with PopART,
on IPUs or on the IPU Model. ``tests/popart_standin/popart.py`` is a stand-in ``popart`` module
with the names and signatures of PopART's Python API that records every call and option set;
these tests put it on ``sys.path`` and check what ``popbert.backends.popart`` asks of PopART:

* the ``popart.SessionOptions`` set for the tiny, base-128 and large-128 presets with replicas,
  replicated tensor sharding, pipelining, recomputation and half weights (``--set`` overrides);
  the ``DataFlow`` (device iterations, anchors) and the IPUs acquired;
* the optimizer: ``popart.Adam`` mode, values, loss scaling, and ``insertSpecific`` for exactly
  the tensors ``popbert.optimizers.classify_parameter`` excludes, plus the frozen constants;
* a learning-rate change reaching the device through ``updateOptimizerFromHost``;
* the weights and state round trips through ``readWeights`` / ``writeWeights``, the layout of
  fed arrays and the per-step means of the anchors, and ``train_loop`` driving the session;
* the half-weight graph PopART is given computes what the FP32 graph computes (checked with
  popbert's own torch lowering, not with PopART);
* without the SDK: one line naming the Poplar SDK, exit status 2, nothing written.

Passing shows that popbert calls PopART's API as intended. It does not show that PopART
accepts these graphs, compiles them, fits them in IPU memory, or trains to the torch backend's
losses: that is what ``scripts/popart_smoke.py`` is for, where the SDK is.

The translation is checked on onnx-dialect graphs built with symbolic batch: what it reads
(weight names, placement annotations, outputs) is the same in both dialects, and the stand-in
does not run the graph; one test feeds a popart-dialect graph, whose static shapes let the
stand-in check the element counts PopART checks.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from trainer_helpers import run_pretraining

from popbert.backends import BackendUnavailable, import_popart, popart_available
from popbert.backends.popart import (
    CAST_SUFFIX,
    NO_WEIGHT_NORM_CLAMP,
    PopartTrainingSession,
    check_run_config,
    store_weights_as,
)
from popbert.backends.popart_options import PopartOptions, acquire_device, device_ipus
from popbert.backends.sessions import make_session
from popbert.builders.bert import build_bert
from popbert.config import RunConfig, dump_config, load_config
from popbert.errors import CheckpointError, ConfigError, InputError, UsageError
from popbert.graph.annotations import (
    IPU_NUMBER,
    PIPELINE_STAGE,
    constant_initializers,
    node_annotation,
    trainable_initializers,
)
from popbert.io import checkpoint as ckpt
from popbert.optimizers import LossScaler, classify_parameter, set_lr
from popbert.runtime.options import SessionOptions
from popbert.runtime.protocol import Session
from popbert.runtime.session import InferenceSession, TrainingSession
from popbert.train.factories import graph_batch_size, loss_scaler, lr_schedule, optimizer_factory
from popbert.train.loop import LoopSettings, train_loop
from popbert.train.pretrain import check_supported

STANDIN = Path(__file__).resolve().parent.parent / "popart_standin"
ROOT = Path(__file__).resolve().parents[2]
POPART = ["execution.backend=popart", "model.dialect=popart"]
# The base/large presets at a few units of width: the translation reads the execution and
# optimizer sections and the graph's names and placement (24 layers on 4 IPUs stay 24 on 4),
# not the hidden size; this keeps their graphs to a second. Their FP16 compute needs an FP16
# graph, which the builder does not emit yet (see test_what_popart_cannot_do): FP32 compute.
NARROW = ["model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
          "model.vocab_size=512", "execution.compute_dtype=float32"]


# -- helpers ----------------------------------------------------------------------------------

@pytest.fixture
def popart(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The stand-in, importable as ``popart`` for one test, its log empty."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "popart", raising=False)
    module = importlib.import_module("popart")
    assert module.__standin__
    module.LOG.clear()
    yield module
    sys.modules.pop("popart", None)


def config(preset: str = "tiny", *overrides: str) -> RunConfig:
    narrow = NARROW if preset != "tiny" else []
    return load_config(preset, [*POPART, *narrow, *overrides])


def onnx_graph(cfg: RunConfig, zeros: bool = False):
    """The graph the translation is checked on: ``cfg.model`` in the onnx dialect."""
    return build_bert(dataclasses.replace(cfg.model, dialect="onnx"), seed=0, zeros=zeros)


def session_of(cfg: RunConfig, graph=None, **popart_options: Any) -> PopartTrainingSession:
    """The session ``popbert pretrain`` makes for ``cfg`` (its arguments, its factories)."""
    graph = graph if graph is not None else onnx_graph(cfg, zeros=cfg.preset != "tiny")
    session = make_session(graph.model(), graph.loss, optimizer_factory(cfg),
                           SessionOptions.from_config(cfg), loss_scaler=loss_scaler(cfg),
                           popart_options=PopartOptions(**popart_options))
    assert isinstance(session, PopartTrainingSession)
    return session


def logged(popart: types.ModuleType, kind: str) -> list[tuple]:
    return [entry[1:] for entry in popart.LOG if entry[0] == kind]


def assigned(popart: types.ModuleType) -> dict[str, Any]:
    """The ``popart.SessionOptions`` attributes the session set, in a comparable form."""
    values = {}
    for name, value in logged(popart, "SessionOptions"):
        if isinstance(value, popart.TensorLocationSettings):
            location = value.location
            value = (location.storage.name, location.replicatedTensorSharding.name,
                     value.minElementsForReplicatedTensorSharding)
        elif hasattr(value, "name"):
            value = value.name
        values[name] = value
    return values


def batch_for(cfg: RunConfig, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of ``rows`` random pre-training samples that fit ``cfg.model`` (the onnx-dialect
    graphs take any micro batch, so most tests feed one row per micro-batch)."""
    m = cfg.model
    g = torch.Generator().manual_seed(seed)
    seq, preds = m.sequence_length, m.max_predictions_per_seq
    return {"input_ids": torch.randint(0, m.vocab_size, (rows, seq), generator=g),
            "segment_ids": torch.randint(0, 2, (rows, seq), generator=g),
            "input_mask": torch.ones(rows, seq, dtype=torch.int64),
            "masked_lm_positions": torch.randint(0, seq, (rows, preds), generator=g),
            "masked_lm_ids": torch.randint(1, m.vocab_size, (rows, preds), generator=g),
            "next_sentence_labels": torch.randint(0, 2, (rows,), generator=g)}


# -- session options, data flow, devices, for the presets -------------------------------------

CASES = {
    "tiny": ("tiny", [], {}, 1),
    "tiny, 2 replicas, RTS, accumulation 4, 3 device iterations": (
        "tiny", ["execution.replicas=2", "execution.replicated_tensor_sharding=true",
                 "execution.gradient_accumulation=4", "execution.device_iterations=3"],
        {"enableReplicatedGraphs": True, "replicatedGraphCount": 2,
         "enableGradientAccumulation": True, "accumulationFactor": 4,
         "accumulationAndReplicationReductionType": "Mean",
         "optimizerStateTensorLocationSettings": ("OnChip", "On", 2)}, 2),
    "tiny, FP16 weights": (
        "tiny", ["execution.weight_dtype=float16"], {"enableStochasticRounding": True}, 1),
    "tiny, FP16 weights rounded to nearest": (
        "tiny", ["execution.weight_dtype=float16", "execution.stochastic_rounding=false"], {}, 1),
    "tiny, 2-stage pipeline": (
        "tiny", ["model.layers_per_ipu=[1,1]", "execution.pipeline=true",
                 "execution.gradient_accumulation=4"],
        {"virtualGraphMode": "Manual", "enablePipelining": True,
         "enableGradientAccumulation": True, "accumulationFactor": 4,
         "accumulationAndReplicationReductionType": "Mean"}, 2),
    "tiny, recompute without pipelining": (
        "tiny", ["model.layers_per_ipu=[2]", "model.recompute=true", "execution.recompute=true"],
        {"virtualGraphMode": "Manual", "autoRecomputation": "RecomputeAll"}, 1),
    "tiny, 3 IPUs (rounded up to 4)": (
        "tiny", ["model.layers_per_ipu=[0,1,1]"], {"virtualGraphMode": "Manual"}, 4),
    "base-128": (
        "base-128", [],
        {"virtualGraphMode": "Manual", "enableGradientAccumulation": True,
         "accumulationFactor": 512, "accumulationAndReplicationReductionType": "Mean",
         "enableStochasticRounding": True}, 4),
    "base-128, 2 replicas, RTS": (
        "base-128", ["execution.replicas=2", "execution.gradient_accumulation=256",
                     "execution.replicated_tensor_sharding=true"],
        {"virtualGraphMode": "Manual", "enableReplicatedGraphs": True,
         "replicatedGraphCount": 2, "enableGradientAccumulation": True,
         "accumulationFactor": 256, "accumulationAndReplicationReductionType": "Mean",
         "enableStochasticRounding": True,
         "optimizerStateTensorLocationSettings": ("OnChip", "On", 2)}, 8),
    "large-128, 4 replicas, RTS, pipelined, recomputed": (
        "large-128", ["execution.replicas=4", "execution.gradient_accumulation=256",
                      "execution.replicated_tensor_sharding=true", "execution.pipeline=true",
                      "execution.recompute=true"],
        {"virtualGraphMode": "Manual", "enablePipelining": True,
         "autoRecomputation": "Pipeline", "enableReplicatedGraphs": True,
         "replicatedGraphCount": 4, "enableGradientAccumulation": True,
         "accumulationFactor": 256, "accumulationAndReplicationReductionType": "Mean",
         "enableStochasticRounding": True,
         "optimizerStateTensorLocationSettings": ("OnChip", "On", 4)}, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_session_options_data_flow_and_device(popart: types.ModuleType, case: str) -> None:
    """Each preset and override sets exactly these ``popart.SessionOptions`` (nothing else:
    PopART's defaults stand), batchesPerStep = device iterations, every scalar output anchored
    with ``ALL``, and replicas × the graph's IPUs (a power of two) acquired."""
    preset, overrides, expected, ipus = CASES[case]
    cfg = config(preset, *overrides)
    session = session_of(cfg)
    assert assigned(popart) == expected
    assert logged(popart, "DeviceManager.acquireAvailableDevice") == [(ipus,)]
    [(batches_per_step, anchors)] = logged(popart, "DataFlow")
    assert batches_per_step == cfg.execution.device_iterations
    assert set(anchors) == {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"}
    assert {art.name for art in anchors.values()} == {"All"}
    [(created,)] = logged(popart, "TrainingSession")
    assert created["loss"] == "loss" and created["numIpus"] == ipus
    calls = [e[0] for e in popart.LOG if e[0].startswith("TrainingSession.")]
    assert calls == ["TrainingSession.prepareDevice", "TrainingSession.weightsFromHost",
                     "TrainingSession.setRandomSeed"]
    assert session.micro_batches_per_run() == (cfg.execution.device_iterations
                                               * cfg.execution.gradient_accumulation
                                               * cfg.execution.replicas)


def test_ipu_model_engine_cache_and_extra_options(popart: types.ModuleType,
                                                  tmp_path: Path) -> None:
    """The IPU Model device, the engine cache, off-chip optimizer state and verbatim extra
    options; a misspelt option is PopART's own AttributeError."""
    session_of(config("base-128"), device="ipu-model", engine_cache=tmp_path / "cache",
               optimizer_state_offchip=True, session_options={"enableOutlining": False})
    assert logged(popart, "DeviceManager.createIpuModelDevice") == [
        ({"numIPUs": "4", "tilesPerIPU": "1472"},)]
    options = assigned(popart)
    assert options["enableEngineCaching"] is True
    assert options["cachePath"] == str(tmp_path / "cache")
    assert options["optimizerStateTensorLocationSettings"] == ("OffChip", "Off", 8192)
    assert options["enableOutlining"] is False
    with pytest.raises(AttributeError, match="enableOutlinning"):
        session_of(config("tiny"), session_options={"enableOutlinning": False})


def test_device_count_and_a_busy_machine(popart: types.ModuleType) -> None:
    assert [device_ipus(r, i) for r, i in [(1, 1), (2, 1), (1, 3), (4, 4), (3, 2), (1, 0)]] == \
        [1, 2, 4, 16, 8, 1]
    with pytest.raises(BackendUnavailable, match="could not acquire 128 IPU"):
        acquire_device(popart, PopartOptions(), 128)
    with pytest.raises(ValueError, match="device must be one of ipu, ipu-model"):
        PopartOptions(device="gpu")


# -- the optimizer ----------------------------------------------------------------------------

def expected_specifics(cfg: RunConfig, proto: onnx.ModelProto) -> dict[str, dict]:
    """``insertSpecific`` calls the rule of ``popbert.optimizers.classify_parameter`` implies
    (no decay → weightDecay 0; no trust ratio under LAMB → maxWeightNorm 0), plus every float
    constant frozen with learning rate 0."""
    lamb = cfg.optimizer.name == "lamb"
    expected: dict[str, dict] = {}
    for name in trainable_initializers(proto):
        decay, trust = classify_parameter(name)
        values = {}
        if not decay and cfg.optimizer.weight_decay:
            values["weightDecay"] = (0.0, True)
        if lamb and not trust:
            values["maxWeightNorm"] = (0.0, True)
        if values:
            expected[name] = values
    floats = {t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    for name in constant_initializers(proto) & floats:
        expected[name] = {"learningRate": (0.0, True), "weightDecay": (0.0, True)}
    return expected


@pytest.mark.parametrize("preset, overrides, mode", [
    ("tiny", [], "Adam"),
    ("tiny", ["optimizer.bias_correction=false"], "AdamNoBias"),
    ("tiny", ["optimizer.name=lamb"], "Lamb"),
    ("base-128", [], "LambNoBias"),
    ("large-128", [], "LambNoBias"),
    ("groupbert-base-128", [], "LambNoBias"),  # grouped FFN and convolution weights too
])
def test_optimizer(popart: types.ModuleType, preset: str, overrides: list[str],
                   mode: str) -> None:
    """``popart.Adam``: the mode of ``optimizer.name`` and ``bias_correction``, the values of
    the config (lr not const, so schedules can change it), loss scaling, clipping, and
    Graphcore's exclusions by ``insertSpecific`` for exactly the right tensor names."""
    cfg = config(preset, *overrides)
    graph = onnx_graph(cfg, zeros=preset != "tiny")
    session_of(cfg, graph)
    o = cfg.optimizer
    [(values, kwargs)] = logged(popart, "Adam")
    expected = {"defaultLearningRate": (o.lr, False), "defaultWeightDecay": (o.weight_decay, True),
                "defaultBeta1": (o.betas[0], True), "defaultBeta2": (o.betas[1], True),
                "defaultEps": (o.eps, True)}
    if o.name == "lamb":
        expected["defaultMaxWeightNorm"] = (NO_WEIGHT_NORM_CLAMP, True)
    if o.loss_scaling == "static":
        expected["lossScaling"] = (o.loss_scale, True)
    assert values == expected
    assert kwargs["mode"].name == mode
    assert kwargs["weight_decay_mode"].name == "Decay"
    assert (kwargs["accl1_type"].name, kwargs["accl2_type"].name) == ("FLOAT", "FLOAT")
    assert kwargs["clip_norm_settings"] == ([o.max_grad_norm] if o.max_grad_norm else [])
    specifics = {name: values for name, values in logged(popart, "Adam.insertSpecific")}
    assert specifics == expected_specifics(cfg, graph.model())
    # The rule's own examples, spelled out: biases and LayerNorm betas lose decay and (LAMB)
    # the trust ratio; gammas lose decay only; matrices keep both.
    assert specifics["Layer0/Attention/QKV/B"]["weightDecay"] == (0.0, True)
    assert "maxWeightNorm" not in specifics["Layer0/Attention/Norm/Gamma"]
    assert "Layer0/Attention/QKV/W" not in specifics
    if o.name == "lamb":
        assert specifics["Embedding/Norm/Beta"]["maxWeightNorm"] == (0.0, True)


def test_an_lr_change_goes_through_update_optimizer_from_host(popart: types.ModuleType) -> None:
    """``set_lr`` on ``session.optimizer`` (what ``popbert pretrain``'s step hook does) reaches
    the device before the next run as a new ``popart.Adam``; an unchanged lr sends nothing;
    changing anything PopART holds const is refused in one line."""
    cfg = config("tiny", "optimizer.warmup_steps=10", "training.steps=20")
    session = session_of(cfg)
    schedule = lr_schedule(cfg)
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    start = session.weights()["Layer0/FF/1/W"].clone()
    for step in range(2):
        session.run(batch_for(cfg, session.micro_batches_per_run(), seed=step))
    updates = logged(popart, "TrainingSession.updateOptimizerFromHost")
    assert updates == [((pytest.approx(schedule(0)), False),),
                       ((pytest.approx(schedule(1)), False),)]
    # The stand-in's run moves every weight by -lr: the device used the scheduled rates...
    moved = start - session.weights()["Layer0/FF/1/W"]
    assert torch.allclose(moved, torch.full_like(moved, schedule(0) + schedule(1)), atol=1e-6)
    # ... and the frozen constants not at all.
    sessions_popart = session._session
    constant = "AttentionMask/big"
    assert np.array_equal(sessions_popart.device[constant],
                          numpy_helper.to_array(next(t for t in session.proto.graph.initializer
                                                     if t.name == constant)))
    set_lr(session.optimizer, schedule(1))
    session.step_hook = None
    session.run(batch_for(cfg, session.micro_batches_per_run()))
    assert len(logged(popart, "TrainingSession.updateOptimizerFromHost")) == 2
    session.optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(UsageError, match="learning rate only"):
        session.run(batch_for(cfg, session.micro_batches_per_run()))


# -- running, weights and state -----------------------------------------------------------------

def test_run_feeds_popart_layout_and_returns_per_step_means(popart: types.ModuleType) -> None:
    """A run's batch goes to PopART as [iterations, accumulation, replicas, micro, ...] in the
    graph's dtype; each scalar anchor comes back as its per-step mean (the stand-in's anchors
    hold step + 0.1·micro-batch + 0.01·replica, so the means are step + 0.055)."""
    cfg = config("tiny", "execution.device_iterations=3", "execution.gradient_accumulation=2",
                 "execution.replicas=2", "execution.micro_batch_size=4",
                 "optimizer.loss_scaling=static", "optimizer.loss_scale=128")
    session = session_of(cfg)
    assert session.micro_batches_per_run() == 12
    outputs = session.run(batch_for(cfg, 48))
    [(shapes,)] = logged(popart, "TrainingSession.run")
    assert shapes["input_ids"] == (3, 2, 2, 4, 128)
    assert shapes["next_sentence_labels"] == (3, 2, 2, 4)
    assert set(outputs) == {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy",
                            "loss_scale"}
    assert outputs["loss"].tolist() == pytest.approx([0.055, 1.055, 2.055])
    assert outputs["loss_scale"].tolist() == [128.0] * 3
    assert session.step == 3
    assert session.run(batch_for(cfg, 48))["loss"].tolist() == pytest.approx([3.055, 4.055,
                                                                              5.055])
    # A batch that does not fit is an InputError before PopART is asked anything.
    before = len(popart.LOG)
    with pytest.raises(InputError, match="12 micro-batches per run"):
        session.run(batch_for(cfg, 40))
    assert len(popart.LOG) == before


def test_popart_dialect_graph_feeds_static_shapes(popart: types.ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the popart dialect's static micro batch, the stand-in checks every fed array's
    element count and dtype against the graph, as PopART's step IO does: the loaders' int64
    batch reaches PyStepIO in the declared UINT32 (numpy uint32), as Graphcore fed it."""
    cfg = config("tiny", "execution.gradient_accumulation=2", "execution.micro_batch_size=4")
    graph = build_bert(cfg.model, seed=0, batch_size=graph_batch_size(cfg))
    session = session_of(cfg, graph)
    fed: list[dict[str, np.ndarray]] = []

    class RecordingStepIO(popart.PyStepIO):
        def __init__(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
            fed.append(dict(inputs))
            super().__init__(inputs, outputs)

    monkeypatch.setattr(popart, "PyStepIO", RecordingStepIO)
    batch = batch_for(cfg, session.micro_batches_per_run() * 4)
    assert {v.dtype for v in batch.values()} == {torch.int64}
    session.run(batch)
    [(shapes,)] = logged(popart, "TrainingSession.run")
    assert shapes["input_ids"] == (2, 4, 128)
    declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                for i in graph.model().graph.input}
    assert {n: a.dtype for n, a in fed[0].items()} == {n: declared[n] for n in fed[0]}
    assert {a.dtype for a in fed[0].values()} == {np.dtype(np.uint32)}
    # A negative id is an InputError naming the input, before the host array is cast (it
    # would wrap to 4294967295) and before PopART is asked anything.
    batch["masked_lm_ids"][0, 0] = -1
    with pytest.raises(InputError, match="'masked_lm_ids' holds -1, outside the graph's UINT32"):
        session.run(batch)
    assert len(fed) == 1
    with pytest.raises(InputError, match=r"graph takes \(4, 128\) per micro-batch"):
        session.run(batch_for(cfg, session.micro_batches_per_run()))


def test_weights_round_trip(popart: types.ModuleType) -> None:
    """``weights()`` reads the device (weightsToHost + readWeights); ``load_weights`` writes
    through writeWeights + weightsFromHost after refreshing the host copies, so a partial load
    keeps what the device trained the other weights to."""
    cfg = config("tiny")
    graph = onnx_graph(cfg)
    session = session_of(cfg, graph)
    initial = {t.name: numpy_helper.to_array(t).copy() for t in graph.model().graph.initializer}
    weights = session.weights()
    assert set(weights) == set(trainable_initializers(graph.model()))
    assert all(np.array_equal(weights[n].numpy(), initial[n]) for n in weights)
    session.run(batch_for(cfg, session.micro_batches_per_run()))
    trained = session.weights()
    assert not torch.equal(trained["NSP/Cls/W"], torch.from_numpy(initial["NSP/Cls/W"]))
    new = torch.full_like(trained["Layer1/FF/2/W"], 0.25, dtype=torch.float64)  # cast on load
    popart.LOG.clear()
    session.load_weights({"Layer1/FF/2/W": new})
    assert [e[0] for e in popart.LOG] == ["TrainingSession.weightsToHost",
                                         "TrainingSession.writeWeights",
                                         "TrainingSession.weightsFromHost"]
    after = session.weights()
    assert torch.equal(after["Layer1/FF/2/W"], new.float())
    assert torch.equal(after["NSP/Cls/W"], trained["NSP/Cls/W"])
    with pytest.raises(KeyError, match="not in the graph"):
        session.load_weights({"Nope/W": new})
    with pytest.raises(ValueError, match="does not match the graph's"):
        session.load_weights({"Layer1/FF/2/W": new[:1]})


def test_state_round_trip_through_a_checkpoint(popart: types.ModuleType, tmp_path: Path) -> None:
    """``state_dict()`` holds the weights, PopART's optimizer state (read like weights), the
    step and the device RNG state; written as a popbert checkpoint and read back, it restores
    all of them. A torch-backend optimizer state is a one-line CheckpointError."""
    cfg = config("tiny", "optimizer.loss_scaling=static", "optimizer.loss_scale=8")
    graph = onnx_graph(cfg)
    session = session_of(cfg, graph)
    session.run(batch_for(cfg, session.micro_batches_per_run()))
    state = session.state_dict()
    moments = state["optimizer"]["popart"]
    assert "Accl1___Layer0/FF/1/W" in moments and "Accl2___Layer0/FF/1/W" in moments
    assert float(moments["Accl1___Layer0/FF/1/W"].flatten()[0]) == 1.0  # the stand-in's count
    assert state["step"] == 1 and state["loss_scaler"]["scale"] == 8.0
    directory = ckpt.save_checkpoint(tmp_path / "step-1",
                                     ckpt.Checkpoint.from_state({"session": state, "loader": {}}),
                                     dump_config(cfg), graph.model())
    for _ in range(2):
        session.run(batch_for(cfg, session.micro_batches_per_run()))
    assert session.step == 3
    session.load_state_dict(ckpt.load_checkpoint(directory).state()["session"])
    assert session.step == 1
    again = session.state_dict()
    assert all(torch.equal(again["weights"][n], state["weights"][n]) for n in state["weights"])
    assert all(torch.equal(again["optimizer"]["popart"][t], moments[t]) for t in moments)
    assert logged(popart, "TrainingSession.setRNGState")[-1] == (state["rng"]["popart"]["state"],)
    with pytest.raises(CheckpointError, match="not PopART's"):
        session.load_state_dict({**state, "optimizer": {"state": {}, "param_groups": []}})
    with pytest.raises(CheckpointError, match="do not fit this model"):
        session.load_state_dict({**state, "weights": {"W": torch.zeros(1)}})


def test_train_loop_drives_it(popart: types.ModuleType) -> None:
    """The one training loop runs the PopART session as it runs the torch one."""
    cfg = config("tiny", "execution.device_iterations=2")
    session = session_of(cfg)

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        seed = 0
        while True:
            seed += 1
            yield batch_for(cfg, session.micro_batches_per_run(), seed)

    result = train_loop(session, batches(), LoopSettings(steps=6, log_every=2))
    assert result.steps_trained == 6 and session.step == 6
    assert result.record["step"] == 6 and "loss" in result.record
    assert len(logged(popart, "TrainingSession.run")) == 3



def weight_checksum(session: PopartTrainingSession, weights: dict[str, torch.Tensor]) -> float:
    """What the stand-in's inference session answers when it holds ``weights`` (and the graph's
    constants): the sum of its float initializers."""
    values = {t.name: numpy_helper.to_array(t) for t in session.proto.graph.initializer}
    values.update({n: w.numpy() for n, w in weights.items()})
    return float(sum(a.astype(np.float64).sum() for a in values.values() if a.dtype.kind == "f"))


def test_evaluate_runs_an_inference_session_on_the_trained_weights(
        popart: types.ModuleType) -> None:
    """``evaluate`` (validation) runs one micro-batch through a ``popart.InferenceSession`` of
    the same graph on IPUs of its own — no replicas, accumulation or pipelining, one batch per
    step, the loss and scalar outputs anchored — made once, given the training session's current
    weights (again only after training changed them), and leaves training as it was."""
    cfg = config("tiny", "model.layers_per_ipu=[1,1]", "execution.pipeline=true",
                 "execution.gradient_accumulation=4", "execution.replicas=2",
                 "execution.replicated_tensor_sharding=true", "execution.micro_batch_size=2")
    session = session_of(cfg)
    untrained = weight_checksum(session, session.weights())
    session.run(batch_for(cfg, session.micro_batches_per_run()))
    trained = session.weights()
    state = session.state_dict()
    popart.LOG.clear()
    outputs = session.evaluate(batch_for(cfg, 2, seed=5))
    [(made,)] = logged(popart, "InferenceSession")
    assert made["numIpus"] == 2  # the graph's 2 IPUs, one replica
    options = assigned(popart)
    assert options.get("virtualGraphMode") == "Manual"
    for key in ("enablePipelining", "enableReplicatedGraphs", "enableGradientAccumulation",
                "optimizerStateTensorLocationSettings", "enableStochasticRounding"):
        assert key not in options, key
    [(batches_per_step, anchors)] = logged(popart, "DataFlow")
    assert batches_per_step == 1
    assert set(anchors) == {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"}
    assert logged(popart, "InferenceSession.writeWeights") == [(sorted(trained),)]
    [(shapes,)] = logged(popart, "InferenceSession.run")
    assert shapes["input_ids"] == (2, 128)  # one micro-batch, no leading factors
    # The answer is the stand-in's checksum of the weights it evaluated with: the trained ones.
    assert set(outputs) == set(anchors)
    assert all(v.dim() == 0 for v in outputs.values())
    assert float(outputs["loss"]) == pytest.approx(weight_checksum(session, trained), rel=1e-6)
    assert float(outputs["loss"]) != pytest.approx(untrained, rel=1e-6)
    # Training untouched: no training-session call but reading its weights, same state after.
    assert {e[0] for e in popart.LOG if e[0].startswith("TrainingSession")} <= {
        "TrainingSession.weightsToHost", "TrainingSession.readWeights"}
    after = session.state_dict()
    assert after["step"] == state["step"] == 1 and after["rng"] == state["rng"]
    assert all(torch.equal(after["weights"][n], state["weights"][n]) for n in state["weights"])

    # Made once; weights sent again only after training changed them.
    popart.LOG.clear()
    session.evaluate(batch_for(cfg, 2, seed=6))
    assert not logged(popart, "InferenceSession") and not logged(
        popart, "InferenceSession.writeWeights")
    session.run(batch_for(cfg, session.micro_batches_per_run()))
    again = session.evaluate(batch_for(cfg, 2, seed=6))
    assert len(logged(popart, "InferenceSession.writeWeights")) == 1
    assert float(again["loss"]) == pytest.approx(weight_checksum(session, session.weights()),
                                                 rel=1e-6)
    # A batch that does not fit is an InputError before PopART is asked anything.
    with pytest.raises(InputError, match="input_ids"):
        session.evaluate({**batch_for(cfg, 2), "input_ids": torch.zeros(2, 7, dtype=torch.int64)})
    session.close()
    assert len(logged(popart, "DeviceInfo.detach")) == 2  # training's IPUs and validation's


def test_train_loop_validates_through_it(popart: types.ModuleType) -> None:
    """The training loop's validation (``eval_every``) runs on the PopART session: ``val_*``
    metrics at the evaluated steps. A popart-dialect graph: the stand-in checks each fed
    micro-batch against its static shapes and UINT32 inputs."""
    cfg = config("tiny", "execution.micro_batch_size=2")
    session = session_of(cfg, build_bert(cfg.model, seed=0, batch_size=graph_batch_size(cfg)))

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for seed in range(1, 100):
            yield batch_for(cfg, session.micro_batches_per_run() * 2, seed)

    validation = [batch_for(cfg, 2, seed=100), batch_for(cfg, 2, seed=101)]
    records: list[dict] = []
    train_loop(session, batches(), LoopSettings(steps=4, log_every=1, eval_every=2),
               validation=validation, on_record=lambda step, record: records.append(record))
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    expected = weight_checksum(session, session.weights())
    assert evaluated[-1]["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert len(logged(popart, "InferenceSession.run")) == 4  # 2 batches x 2 evaluations


# -- half weights ---------------------------------------------------------------------------------

def test_half_weights_are_stored_in_float16_and_computed_from_fp32_views(
        popart: types.ModuleType) -> None:
    """``weight_dtype: float16``: PopART gets FLOAT16 initializers read through Casts placed
    with their consumers (a tied weight used in two stages gets a Cast in each); the weights
    come back and go in as float16."""
    cfg = config("tiny", "execution.weight_dtype=float16", "model.layers_per_ipu=[1,1]",
                 "execution.pipeline=true", "execution.gradient_accumulation=2")
    session = session_of(cfg)
    graph = session.proto.graph
    stored = {t.name: t.data_type for t in graph.initializer}
    for name in trainable_initializers(session.proto):
        assert stored[name] == onnx.TensorProto.FLOAT16, name
    assert all(stored[n] != onnx.TensorProto.FLOAT16 for n in constant_initializers(session.proto))
    casts = [n for n in graph.node if n.op_type == "Cast" and CAST_SUFFIX in n.output[0]]
    producers = {o: n for n in graph.node for o in n.output}
    for cast in casts:
        consumer = next(n for n in graph.node if cast.output[0] in n.input)
        assert node_annotation(cast, IPU_NUMBER) == node_annotation(consumer, IPU_NUMBER)
        assert node_annotation(cast, PIPELINE_STAGE) == node_annotation(consumer, PIPELINE_STAGE)
        assert cast.input[0] not in producers
    tied = [c for c in casts if c.input[0] == "Embedding/Embedding_Dict"]
    assert len({node_annotation(c, PIPELINE_STAGE) for c in tied}) == 2
    assert session.weights()["Layer0/FF/1/W"].dtype == torch.float16
    session.load_weights({"Layer0/FF/1/W": torch.zeros(session.layout.weights["Layer0/FF/1/W"][0])})
    assert session.weights()["Layer0/FF/1/W"].dtype == torch.float16


def test_the_half_weight_graph_computes_what_the_fp32_graph_computes() -> None:
    """The graph handed to PopART for FP16 weights, run by popbert's torch lowering (not by
    PopART), equals the FP32 graph holding the same FP16-rounded weights, and is valid ONNX."""
    cfg = config("tiny", "model.layers_per_ipu=[1,1]")
    proto = onnx_graph(cfg).model()
    half = store_weights_as(proto, "float16")
    onnx.checker.check_model(half, full_check=True)
    rounded = onnx.ModelProto()
    rounded.CopyFrom(proto)
    weights = set(trainable_initializers(proto))
    for tensor in rounded.graph.initializer:
        if tensor.name in weights:
            array = numpy_helper.to_array(tensor).astype(np.float16).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    batch = batch_for(cfg, 4)
    ours = InferenceSession(half).run(batch)
    reference = InferenceSession(rounded).run(batch)
    for name in ("loss", "mlm_logits", "nsp_logits"):
        torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=1e-6)


# -- what has no translation, and a machine without the SDK ----------------------------------------

def test_what_popart_cannot_do(popart: types.ModuleType) -> None:
    """One-line ConfigErrors, from the config before anything runs and from the session."""
    for overrides, fragment in [
            (["execution.weight_dtype=bfloat16"], "IPUs store weights in float16 or float32"),
            (["optimizer.loss_scaling=dynamic"], "scales the loss statically"),
            (["optimizer.name=lamb", "optimizer.max_trust_ratio=2.0"], "no trust-ratio clamp")]:
        with pytest.raises(ConfigError, match=fragment):
            check_run_config(config("tiny", *overrides))
        with pytest.raises(ConfigError, match=fragment):
            check_supported(config("tiny", *overrides))
    # base-128 computes in FP16 on the torch backend; PopART computes in the graph's dtype.
    cfg = load_config("base-128", [*POPART, *NARROW[:-1]])
    with pytest.raises(ConfigError, match="compute_dtype .*'float16'.* float32 here") as error:
        session_of(cfg)
    assert "\n" not in str(error.value)
    graph = onnx_graph(config("tiny"))
    with pytest.raises(ConfigError, match="scales the loss statically"):
        make_session(graph.model(), graph.loss, optimizer_factory(config("tiny")),
                     SessionOptions(backend="popart"), loss_scaler=LossScaler(8.0))
    with pytest.raises(UsageError, match="translates popbert.optimizers.Lamb and AdamW"):
        make_session(graph.model(), graph.loss,
                     lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
                     SessionOptions(backend="popart"))


def test_a_graph_beyond_opset_11_is_warned_about(popart: types.ModuleType,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    session_of(config("tiny"))
    assert "PopART reads up to opset 11" in caplog.text


def test_popart_under_torchrun_is_refused(popart: types.ModuleType, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """PopART runs every replica from one process: under torchrun the job stops in one line,
    before writing anything."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="not under torchrun"):
        run_pretraining(config("tiny", "execution.replicas=2"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def no_popart(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import popart`` fails, as on a machine without the Poplar SDK."""
    monkeypatch.setitem(sys.modules, "popart", None)


def test_without_the_sdk_the_session_says_so_in_one_line(no_popart: None) -> None:
    assert not popart_available()
    cfg = config("tiny")
    graph = onnx_graph(cfg)
    with pytest.raises(BackendUnavailable) as error:
        make_session(graph.model(), graph.loss, optimizer_factory(cfg),
                     SessionOptions(), backend="popart")
    message = str(error.value)
    assert "Poplar SDK" in message and "\n" not in message
    assert isinstance(error.value, ImportError)
    with pytest.raises(BackendUnavailable, match="^execution.backend is 'popart': .*Poplar SDK"):
        check_supported(cfg)


def test_a_popart_that_is_not_graphcores_counts_as_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "popart", types.ModuleType("popart"))
    with pytest.raises(BackendUnavailable, match="is not Graphcore's PopART"):
        import_popart()


def test_the_cli_says_so_in_one_line_with_exit_status_2(tmp_path: Path) -> None:
    """``popbert pretrain`` with the PopART backend where the SDK is missing: one stderr line
    naming the Poplar SDK, exit status 2, no output directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "popbert", "pretrain", "--set", "execution.backend=popart",
         "--set", "model.dialect=popart", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("popbert: error: execution.backend is 'popart': ")
    assert "Poplar SDK" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_torch_path_is_the_torch_session(popart: types.ModuleType) -> None:
    """No backend, or backend="torch", is the torch session as before; an unknown one is a
    ValueError, in make_session and in the options; both sessions implement the protocol, and
    the torch session refuses options naming another backend."""
    cfg = load_config("tiny")
    graph = onnx_graph(cfg)
    for kwargs in ({}, {"backend": "torch"}):
        session = make_session(graph.model(), graph.loss, optimizer_factory(cfg),
                               SessionOptions(), **kwargs)
        assert type(session) is TrainingSession and hasattr(session, "module")
        assert isinstance(session, Session)
    assert isinstance(session_of(config("tiny")), Session)
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        make_session(graph.model(), graph.loss, optimizer_factory(cfg), backend="tpu")
    with pytest.raises(ValueError, match="make_session"):
        TrainingSession(graph.model(), graph.loss, optimizer_factory(cfg),
                        SessionOptions(backend="popart"))
    with pytest.raises(ValueError, match="SessionOptions.backend must be one of"):
        SessionOptions(backend="tpu")
    assert SessionOptions.from_config(config("tiny")).backend == "popart"


def test_the_smoke_script_imports_without_the_sdk() -> None:
    """``scripts/popart_smoke.py`` cannot run here; it must at least import and say why."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "popart_smoke.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "IPU Model" in proc.stdout


def test_fewer_micro_batches_per_step_are_refused(popart: types.ModuleType) -> None:
    """Batch-size warmup is the torch backend's: PopART's steps are compiled for
    `gradient_accumulation` micro-batches (the config refuses `training.batch_warmup` first)."""
    cfg = config("tiny", "execution.gradient_accumulation=2", "execution.micro_batch_size=2")
    session = session_of(cfg)
    with pytest.raises(InputError, match=r"take gradient_accumulation \(2\) micro-batches each, "
                       r"not 1 \(batch-size warmup needs the torch backend\)"):
        session.run(batch_for(cfg, 2), micro_batches=1)
    assert session.step == 0 and not logged(popart, "TrainingSession.run")
