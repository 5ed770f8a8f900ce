"""`popbert plan`: parameters, state bytes, activations and FLOPs per device and stage, checked
against what the graph holds, what a real session allocates and the analytic BERT counts.

Each preset's graph is built once for the module (BERT-Large takes seconds) and handed to every
plan and CLI call through `popbert.plan.estimate.build_training_graph`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import onnx
import pytest
from bert_helpers import padded_batch, small_config

from popbert.builders.bert import build_bert
from popbert.cli.main import main
from popbert.config import RunConfig, load_config
from popbert.graph.annotations import trainable_initializers
from popbert.plan import (
    DEVICES,
    custom_device,
    device_named,
    estimate,
    plan_dict,
    plan_run,
    plan_table,
    training_flops_per_sequence,
)
from popbert.plan.activations import activation_model
from popbert.plan.shapes import infer_tensor_shapes

_GRAPHS: dict[tuple[str, int], onnx.ModelProto] = {}
FOUR_REPLICAS = ("execution.replicas=4", "training.global_batch_size=null")
_build = estimate.build_training_graph


def cached_graph(cfg: RunConfig) -> onnx.ModelProto:
    key = (repr(cfg.model), cfg.execution.micro_batch_size)
    if key not in _GRAPHS:
        _GRAPHS[key] = _build(cfg)
    return _GRAPHS[key]


@pytest.fixture(autouse=True)
def reuse_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimate, "build_training_graph", cached_graph)


def plan_of(preset: str, *overrides: str, target=None):
    return plan_run(load_config(preset, list(overrides)), target, config_name=preset)


def hf_pretraining_parameters(cfg: RunConfig) -> int:
    """Parameters of `transformers.BertForPreTraining` (decoder tied to the word embedding)."""
    m = cfg.model
    h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
    embeddings = (v + m.max_position_embeddings + m.type_vocab_size) * h + 2 * h
    layer = (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    pooler = h * h + h
    heads = (h * h + h) + 2 * h + v + (h * 2 + 2)  # MLM transform, LayerNorm, bias; NSP
    return embeddings + m.num_layers * layer + pooler + heads


def analytic_training_flops(cfg: RunConfig) -> int:
    """3 × forward matmuls: encoder 2·S·(4H² + 2HI) per layer, attention 4·S²·H per layer, the
    MLM head on P positions 2·P·(H² + HV), pooler 2·H² and NSP 2·2H."""
    m = cfg.model
    s, h, i, v, p = (m.sequence_length, m.hidden_size, m.intermediate_size, m.vocab_size,
                     m.max_predictions_per_seq)
    forward = (m.num_layers * (2 * s * (4 * h * h + 2 * h * i) + 4 * s * s * h)
               + 2 * p * (h * h + h * v) + 2 * h * h + 2 * 2 * h)
    return 3 * forward


# ---------------------------------------------------------------------------------------------
# Parameters and placement


@pytest.mark.parametrize("preset", ["tiny", "base-128", "large-128"])
def test_parameters_are_the_graphs_trainable_weights(preset: str) -> None:
    cfg = load_config(preset)
    graph = cached_graph(cfg)
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.graph.initializer}
    plan = plan_run(cfg)
    assert plan.totals.parameters == sum(sizes[n] for n in trainable_initializers(graph))
    assert plan.totals.parameters == hf_pretraining_parameters(cfg)
    expected = {"base-128": 110_106_428, "large-128": 336_226_108}  # BERT-Base / -Large
    if preset in expected:
        assert plan.totals.parameters == expected[preset]


@pytest.mark.parametrize("preset, layers", [("base-128", [0, 4, 4, 4]),
                                            ("large-128", [3, 7, 7, 7])])
def test_one_row_per_device_and_stage_in_graphcores_placement(preset: str,
                                                              layers: list[int]) -> None:
    plan = plan_of(preset)
    cfg = load_config(preset)
    assert [(s.ipu, s.stage) for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 4)]
    m = cfg.model
    h, i = m.hidden_size, m.intermediate_size
    layer = 4 * h * h + 2 * h * i + 9 * h + i  # QKV, Out, FF1, FF2 weights and biases, 2 norms
    embeddings = (m.vocab_size + m.max_position_embeddings + m.type_vocab_size) * h + 2 * h
    assert [s.parameters for s in plan.stages[:4]] == [
        embeddings + layers[0] * layer, *(n * layer for n in layers[1:])]


@pytest.mark.parametrize("preset", ["base-128", "large-128"])
@pytest.mark.parametrize("pipeline", [False, True])
def test_per_stage_and_per_device_sums_equal_the_totals(preset: str, pipeline: bool) -> None:
    plan = plan_of(preset, f"execution.pipeline={str(pipeline).lower()}", *FOUR_REPLICAS,
                   "execution.replicated_tensor_sharding=true")
    for key in ("parameters", "weight_bytes", "gradient_bytes", "optimizer_bytes",
                "gradient_bytes_rts", "optimizer_bytes_rts", "training_flops_per_sequence"):
        assert sum(getattr(s, key) for s in plan.stages) == getattr(plan.totals, key), key
    assert sum(d.parameters for d in plan.devices) == plan.totals.parameters
    assert len(plan.devices) == (4 if pipeline else 1)
    for key in ("weight_bytes", "gradient_bytes", "optimizer_bytes"):
        total = getattr(plan.totals, key.replace("_bytes", "_bytes_rts")
                        if key != "weight_bytes" else key)
        assert abs(sum(getattr(d, key) for d in plan.devices) - total) <= len(plan.stages), key


# ---------------------------------------------------------------------------------------------
# Bytes per parameter


def test_rts_divides_the_optimizer_state_by_the_replicas() -> None:
    plain = plan_of("base-128", *FOUR_REPLICAS)
    sharded = plan_of("base-128", *FOUR_REPLICAS, "execution.replicated_tensor_sharding=true")
    n = plain.totals.parameters
    assert plain.totals.optimizer_bytes == 8 * n
    assert plain.totals.optimizer_bytes_rts == pytest.approx(8 * n / 4, abs=5)
    assert sharded.devices[0].optimizer_bytes == math.ceil(8 * n / 4)
    assert plain.devices[0].optimizer_bytes == 8 * n
    # FP16 weights: the flat gradient (2) + the FP32 accumulated shard (4/4) + the
    # reduce-scatter output (2/4), against 2 bytes/parameter of .grad without RTS.
    assert plain.devices[0].gradient_bytes == 2 * n
    assert sharded.devices[0].gradient_bytes == math.ceil(n * (2 + 1 + 0.5))
    # With one replica RTS still keeps the FP32 accumulator: 2 + 4 bytes.
    single = plan_of("base-128", "execution.replicated_tensor_sharding=true")
    assert single.devices[0].gradient_bytes == 6 * n


def test_half_weights_halve_the_weight_and_gradient_bytes() -> None:
    fp32 = plan_of("tiny")
    for dtype in ("float16", "bfloat16"):
        half = plan_of("tiny", f"execution.weight_dtype={dtype}")
        assert fp32.totals.weight_bytes == 4 * fp32.totals.parameters
        assert half.totals.weight_bytes * 2 == fp32.totals.weight_bytes
        assert half.totals.gradient_bytes * 2 == fp32.totals.gradient_bytes
        assert half.totals.optimizer_bytes == fp32.totals.optimizer_bytes  # FP32 moments
        # ... but the torch backend computes from FP32 views of them (4 bytes/parameter).
        assert half.devices[0].weight_view_bytes == 4 * fp32.totals.parameters
        assert fp32.devices[0].weight_view_bytes == 0


def test_the_state_bytes_are_what_a_session_allocates() -> None:
    """Weights and FP32 moments of a real session after a step, unsharded and sharded."""
    import torch
    from memory_helpers import gradient_shard_bytes, optimizer_state_bytes

    from popbert.distributed.replicas import Replicas
    from popbert.distributed.sharded import ShardedOptimizer
    from popbert.optimizers import AdamW, param_groups_by_name
    from popbert.runtime.options import SessionOptions
    from popbert.runtime.session import TrainingSession

    overrides = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=2",
                 "model.intermediate_size=128", "model.sequence_length=32",
                 "model.max_position_embeddings=32", "model.max_predictions_per_seq=4",
                 "execution.micro_batch_size=4"]
    for dtype in ("float32", "float16"):
        cfg = load_config("tiny", [*overrides, f"execution.weight_dtype={dtype}"])
        plan = plan_run(cfg)
        torch.manual_seed(0)
        session = TrainingSession(
            cached_graph(cfg), "loss",
            lambda named: AdamW(param_groups_by_name(named, 0.01), lr=1e-3, seed=0),
            SessionOptions(weight_dtype=dtype))
        session.run(padded_batch(cfg.model, 4))
        weights = sum(p.numel() * p.element_size() for _, p in session.named_parameters)
        grads = sum(p.grad.numel() * p.grad.element_size() for _, p in session.named_parameters)
        assert weights == plan.totals.weight_bytes
        assert grads == plan.totals.gradient_bytes
        assert optimizer_state_bytes(session.optimizer) == plan.totals.optimizer_bytes
        sharded = ShardedOptimizer(
            AdamW(param_groups_by_name(session.named_parameters, 0.01), lr=1e-3),
            Replicas.single())
        # Flat buffers align each tensor to 16 elements: a few hundred bytes more.
        assert optimizer_state_bytes(sharded) == pytest.approx(plan.totals.optimizer_bytes_rts,
                                                               rel=0.01)
        held = gradient_shard_bytes(sharded) + sum(
            s.space.grads.numel() * s.space.grads.element_size() for s in sharded.shards)
        assert held == pytest.approx(plan.totals.gradient_bytes_rts, rel=0.01)


def test_the_cpu_tile_is_the_optimizers() -> None:
    from popbert.optimizers.tiling import CPU_TILE_NUMEL

    assert estimate.CPU_TILE_NUMEL == CPU_TILE_NUMEL


# ---------------------------------------------------------------------------------------------
# Activations and recompute regions


def test_recompute_keeps_less_than_the_whole_forward_pass() -> None:
    plan = plan_of("base-128")
    for stage in plan.stages[1:4]:  # four layers, three checkpoints each
        assert stage.activation_bytes_recompute < 0.5 * stage.activation_bytes
    assert plan.totals.activation_bytes_recompute < 0.5 * plan.totals.activation_bytes
    tiny = plan_of("tiny", "execution.recompute=true")  # no checkpoints in the tiny graph
    assert tiny.totals.activation_bytes_recompute == tiny.totals.activation_bytes
    assert any("no checkpoints" in note for note in tiny.notes)


def test_half_compute_keeps_between_half_and_all_of_the_fp32_activations() -> None:
    fp32 = plan_of("tiny").devices[0]
    for kind in ("cpu", "cuda"):
        half = plan_of("tiny", "execution.compute_dtype=bfloat16",
                       f"execution.device={kind}").devices[0]
        # Matmuls run in BF16; the loss (and on CUDA LayerNorm and softmax) in FP32.
        assert 0.5 * fp32.activation_bytes < half.activation_bytes < 0.95 * fp32.activation_bytes
        assert half.weight_view_bytes > 0  # autocast's BF16 copies of the matmul weights
    ipu = plan_of("tiny", "execution.compute_dtype=float16", target=device_named("ipu-mk2"))
    assert ipu.totals.activation_bytes < 0.55 * fp32.activation_bytes  # FP16 throughout


def test_activations_grow_with_the_micro_batch() -> None:
    small = plan_of("tiny", "execution.micro_batch_size=8").totals.activation_bytes
    large = plan_of("tiny", "execution.micro_batch_size=32").totals.activation_bytes
    assert 3.5 < large / small <= 4.0


def test_gradient_accumulation_does_not_grow_the_unpipelined_peak() -> None:
    """A micro-batch's outputs die with it (the session keeps only scalars), so accumulating
    over more micro-batches costs no activation memory unless a pipeline keeps them in flight."""
    one = plan_of("tiny").devices[0]
    four = plan_of("tiny", "execution.gradient_accumulation=4").devices[0]
    assert four.forward_backward_bytes == one.forward_backward_bytes


@pytest.mark.parametrize("layers_per_ipu, pipeline", [([4], False), ([2, 2], True)])
def test_regions_are_the_runtimes_partitions(layers_per_ipu: list[int], pipeline: bool) -> None:
    """The plan's recompute regions are the partitions `popbert.runtime.partition` runs."""
    from popbert.lowering import lower_to_fx
    from popbert.runtime.partition import Program

    config = small_config(num_layers=4, layers_per_ipu=layers_per_ipu, recompute=True)
    model = build_bert(config, batch_size=2).model()
    program = Program(lower_to_fx(model, trainable=True), pipeline=pipeline, recompute=True,
                      device="cpu")
    stages, _ = estimate._stages_and_ipus(model)
    if not pipeline:
        stages = [0] * len(stages)
    regions = activation_model(model, infer_tensor_shapes(model, 2), stages).regions
    partitions = sorted(program.partitions.values(), key=lambda p: (p.stage, p.region))
    assert [(r.stage, r.region, r.recomputed) for r in regions] == [
        (p.stage, p.region, p.recompute) for p in partitions]


# ---------------------------------------------------------------------------------------------
# FLOPs


@pytest.mark.parametrize("preset, gflop", [("base-128", 69.9), ("large-128", 240.6)])
def test_training_flops_match_the_analytic_count(preset: str, gflop: float) -> None:
    cfg = load_config(preset)
    flops = training_flops_per_sequence(cached_graph(cfg))
    assert flops == analytic_training_flops(cfg)  # exact: every matmul, nothing else
    assert flops / 1e9 == pytest.approx(gflop, abs=0.05)  # the published per-sequence figure
    m = cfg.model
    encoder = m.num_layers * (4 * m.hidden_size**2 + 2 * m.hidden_size * m.intermediate_size)
    rule = 6 * encoder * m.sequence_length  # 6·N·tokens over the encoder's matmul weights
    assert 1.0 < flops / rule < 1.08  # + attention matmuls (4-5%) and the MLM head (2-3%)
    assert plan_of(preset).totals.training_flops_per_sequence == flops


def test_fused_attention_counts_like_the_explicit_matmuls() -> None:
    explicit = load_config("tiny")
    fused = load_config("tiny", ["model.attention_dropout=0"])
    fused_graph = cached_graph(fused)
    assert "Attention" in {n.op_type for n in fused_graph.graph.node}
    assert "Attention" not in {n.op_type for n in cached_graph(explicit).graph.node}
    assert (training_flops_per_sequence(fused_graph)
            == training_flops_per_sequence(cached_graph(explicit))
            == analytic_training_flops(explicit))


def test_flops_per_sequence_do_not_depend_on_the_batch() -> None:
    cfg = load_config("tiny")
    symbolic = build_bert(cfg.model, zeros=True).model()  # batch dimension "batch_size"
    assert training_flops_per_sequence(symbolic) == training_flops_per_sequence(
        cached_graph(cfg))


# ---------------------------------------------------------------------------------------------
# Devices and the verdict


def test_device_memory() -> None:
    assert DEVICES["ipu-mk2"].memory_bytes == 1472 * 624 * 1024  # "900 MB" per IPU
    assert device_named("H100").memory_bytes == 80 * 10**9
    assert custom_device(0.5).memory_bytes == 500_000_000


def test_a_tiny_memory_does_not_fit_and_a_large_one_does() -> None:
    assert plan_of("tiny", target=custom_device(0.001)).fits is False
    assert plan_of("tiny", target=device_named("h100")).fits is True
    assert plan_of("tiny").fits is None
    table = plan_table(plan_of("large-128", "execution.pipeline=true",
                               target=device_named("ipu-mk2")))
    assert table.count("DOES NOT FIT") == 4  # one line per IPU


def test_cli_table_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", "tiny", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "FITS, margin" in out and "total" in out and "GFLOP" in out
    assert main(["plan", "--config", "tiny", "--memory-gb", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "device 0: needs" in out and "DOES NOT FIT" in out
    assert main(["plan", "--config", "base-128", "--set", "execution.pipeline=true",
                 "--device", "ipu-mk2"]) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows[:5]] == [("0", "0"), ("1", "1"), ("2", "2"), ("3", "3"),
                                                ("0", "4")]


@pytest.mark.parametrize("preset", ["tiny", "base-128", "large-128"])
def test_cli_json_parses(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", preset, "--json", "--device", "a100-80gb"]) in (0, 1)
    result = json.loads(capsys.readouterr().out)
    assert result["totals"]["parameters"] == hf_pretraining_parameters(load_config(preset))
    assert result["training_flops_per_sequence"] == analytic_training_flops(load_config(preset))
    assert result["fits"] == all(d["fits"] for d in result["devices"])
    assert result["target"]["memory_bytes"] == 80 * 10**9
    assert plan_dict(plan_of(preset))["fits"] is None


@pytest.mark.parametrize("args, fragment", [
    (["--device", "ipu-mk3"], "unknown device"),
    (["--memory-gb", "0"], "must be a positive number"),
    (["--set", "execution.replicas=0"], "execution.replicas"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], fragment: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("popbert: error:") and "\n" not in err and fragment in err


def test_device_and_memory_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--device", "h100", "--memory-gb", "1"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_plan_does_not_import_torch() -> None:
    code = ("import sys; from popbert.cli.main import main; main(['plan', '--json']); "
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "False"
    assert json.loads(proc.stdout)["totals"]["parameters"] > 0


def test_groupbert_flops_count_the_grouped_convolution() -> None:
    """GroupBERT's convolution is counted: 2·B·S·H·(channels per group)·kernel per layer."""
    from popbert.builders.bert import build_bert
    from popbert.plan.flops import forward_flops_by_node

    cfg = load_config("groupbert-mini", ["model.num_layers=1"])
    m = cfg.model
    model = build_bert(m, batch_size=2).model()
    convs = [f for node, f in zip(model.graph.node, forward_flops_by_node(model))
             if node.op_type == "Conv"]
    assert convs == [2 * 2 * m.sequence_length * m.hidden_size * m.groupbert.conv_group_size
                     * m.groupbert.conv_kernel_size]
