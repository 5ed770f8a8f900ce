"""`popbert plan` of ModernBERT: parameters, FLOPs, activations and the report's family name.

The graph is what `popbert plan` counts, so the checks are against the built graph and against
hand counts of ModernBERT's shape: no position or segment tables (rotary tables are constants),
bias-free by default, a GeGLU MLP (Wi: H -> 2I, Wo: I -> H), pre-LayerNorm with layer 0's
attention norm the identity, a final LayerNorm, MLM only. Sliding-window layers compute full
S x S scores under a band mask in popbert's graph, so their FLOPs are full attention's.

Activations were checked against measured CPU steps with benchmarks/plan_accuracy.py's method
(the `fast` preset, a ModernBERT, at micro batch 16: within 0.3% of the measured peak, fused
attention or not);
measuring is too slow for this file, so the two op rules ModernBERT needed are checked here on
the graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import ARCHITECTURES
from popbert.builders.families import FAMILIES
from popbert.cli.main import main
from popbert.config import RunConfig, load_config
from popbert.graph.annotations import trainable_initializers
from popbert.plan import plan_dict, plan_run, plan_table, training_flops_per_sequence
from popbert.plan.activations import CONTIGUOUS_COPY, activation_model
from popbert.plan.flops import forward_flops_by_node
from popbert.plan.shapes import infer_tensor_shapes

BATCH = 2
# 4 layers: 0 and 3 global, 1 and 2 in a window of 4 tokens each side of 32.
SMALL = ["model.vocab_size=300", "model.hidden_size=32", "model.num_heads=2",
         "model.num_layers=4", "model.intermediate_size=48", "model.sequence_length=32",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=6",
         "model.modernbert.local_attention=8", "model.modernbert.global_attn_every_n_layers=3",
         f"execution.micro_batch_size={BATCH}"]
ALL_BIASES = ["model.modernbert.attention_bias=true", "model.modernbert.mlp_bias=true",
              "model.modernbert.norm_bias=true", "model.modernbert.classifier_bias=true"]
_GRAPHS: dict[str, onnx.ModelProto] = {}


def small(*overrides: str) -> RunConfig:
    return load_config("fast", [*SMALL, *overrides])


def graph_of(cfg: RunConfig) -> onnx.ModelProto:
    key = repr(cfg.model)
    if key not in _GRAPHS:
        _GRAPHS[key] = build_bert(cfg.model, zeros=True, batch_size=BATCH).model()
    return _GRAPHS[key]


def modernbert_parameters(cfg: RunConfig) -> int:
    """`transformers.ModernBertForMaskedLM`'s parameters (decoder tied to the embeddings)."""
    m, o = cfg.model, cfg.model.modernbert
    h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
    norm = h + (h if o.norm_bias else 0)
    attention = h * 3 * h + h * h + (4 * h if o.attention_bias else 0)  # Wqkv, Wo
    mlp = h * 2 * i + i * h + (2 * i + h if o.mlp_bias else 0)  # Wi, Wo
    layers = m.num_layers * (norm + attention + norm + mlp) - norm  # layer 0: no attn norm
    head = h * h + (h if o.classifier_bias else 0) + norm + (v if o.decoder_bias else 0)
    return v * h + norm + layers + norm + head  # embeddings, layers, final norm, MLM head


def layer_flops(cfg: RunConfig) -> int:
    """Forward FLOPs of one layer at the micro batch, by hand: Wqkv, Wo, Wi, Wo (2·M·N·K) and
    the score and context matmuls over the full S x S (2·B·S·S·H each)."""
    m = cfg.model
    b, s, h, i = BATCH, m.sequence_length, m.hidden_size, m.intermediate_size
    dense = 2 * b * s * (h * 3 * h + h * h + h * 2 * i + i * h)
    return dense + 2 * (2 * b * s * s * h)


# ---------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("biases", [False, True])
def test_parameters_are_the_graphs_trainable_weights(biases: bool) -> None:
    cfg = small(*(ALL_BIASES if biases else []))
    graph = graph_of(cfg)
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.graph.initializer}
    trainable = trainable_initializers(graph)
    plan = plan_run(cfg, model=graph)
    assert plan.totals.parameters == sum(sizes[n] for n in trainable)
    assert plan.totals.parameters == modernbert_parameters(cfg)
    # The rotary cos/sin tables and the window's positions are constants, not parameters.
    assert not [n for n in trainable if "Rotary" in n or "WindowMask" in n]
    assert any("Rotary" in n for n in sizes)
    assert plan.totals.weight_bytes == 4 * plan.totals.parameters


def test_modernbert_base_has_the_published_parameter_count() -> None:
    """ModernBERT-base's 149,655,232 (answerdotai/ModernBERT-base), from its config alone."""
    assert modernbert_parameters(load_config("modernbert-base")) == 149_655_232


def test_pipeline_stages_split_the_parameters() -> None:
    cfg = small("model.layers_per_ipu=[2,2]", "execution.pipeline=true")
    plan = plan_run(cfg, model=graph_of(cfg))
    assert [(s.ipu, s.stage) for s in plan.stages] == [(0, 0), (1, 1), (0, 2)]
    for key in ("parameters", "weight_bytes", "training_flops_per_sequence"):
        assert sum(getattr(s, key) for s in plan.stages) == getattr(plan.totals, key), key
    assert plan.totals.parameters == modernbert_parameters(cfg)


# ---------------------------------------------------------------------------------------------
# FLOPs


@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])  # fused Attention op / MatMuls
def test_each_layers_matmuls_match_the_hand_count(attention_dropout: float) -> None:
    cfg = small(f"model.attention_dropout={attention_dropout}")
    graph = graph_of(cfg)
    fused = any(n.op_type == "Attention" for n in graph.graph.node)
    assert fused == (attention_dropout == 0.0)
    flops = forward_flops_by_node(graph, infer_tensor_shapes(graph, BATCH))
    per_layer = [sum(f for node, f in zip(graph.graph.node, flops)
                     if node.name.startswith(f"Layer{i}/")) for i in range(4)]
    # Global (0, 3) and sliding-window (1, 2) layers alike: the window is a mask over full
    # S x S scores in popbert's graph, so it costs full attention's FLOPs.
    assert per_layer == [layer_flops(cfg)] * 4


def test_training_flops_are_three_times_the_forward_matmuls() -> None:
    cfg = small()
    m = cfg.model
    h, v, p = m.hidden_size, m.vocab_size, m.max_predictions_per_seq
    head = 2 * p * (h * h + h * v)  # MLM transform and tied decoder on P positions
    expected = 3 * (m.num_layers * layer_flops(cfg) // BATCH + head)  # no NSP, no pooler
    graph = graph_of(cfg)
    assert training_flops_per_sequence(graph) == expected
    assert plan_run(cfg, model=graph).totals.training_flops_per_sequence == expected


# ---------------------------------------------------------------------------------------------
# Activations


def test_the_rotary_halves_are_views_that_keep_nothing() -> None:
    """The lowering slices with basic indexing: the halves share the QKV output's storage."""
    cfg = small()
    graph = graph_of(cfg)
    am = activation_model(graph, infer_tensor_shapes(graph, BATCH), [0] * len(graph.graph.node))
    slices = [n for n in graph.graph.node if n.op_type == "Slice" and "Rotary" in n.name]
    assert len(slices) == 2 * 2 * 4  # two halves of Q and K in each of the 4 layers
    kept = set().union(*(r.kept for r in am.regions))
    for node in slices:
        assert node.output[0] not in am.nbytes and node.output[0] not in kept
        assert am.base[node.output[0]] == am.base.get(node.input[0], node.input[0])


def test_explicit_attention_keeps_contiguous_copies_of_the_rotated_heads() -> None:
    """torch.matmul keeps contiguous copies of the heads-first Q, K and V, not the storages they
    view (the rotated Q and K and the whole QKV output)."""
    cfg = small("model.attention_dropout=0.1", "execution.compute_dtype=float32")
    m = cfg.model
    graph = graph_of(cfg)
    am = activation_model(graph, infer_tensor_shapes(graph, BATCH), [0] * len(graph.graph.node))
    kept = set().union(*(r.kept for r in am.regions))
    copies = [n for n in kept if n.endswith(CONTIGUOUS_COPY)]
    assert len(copies) == 3 * m.num_layers
    assert {am.nbytes[n] for n in copies} == {BATCH * m.sequence_length * m.hidden_size * 4}
    fused = graph_of(small("execution.compute_dtype=float32"))
    assert plan_run(cfg, model=graph).totals.activation_bytes > plan_run(
        small("execution.compute_dtype=float32"), model=fused).totals.activation_bytes


# ---------------------------------------------------------------------------------------------
# The report


def test_the_report_names_modernbert_and_its_window() -> None:
    cfg = small()
    plan = plan_run(cfg, model=graph_of(cfg), config_name="small")
    table = plan_table(plan)
    assert table.startswith("popbert plan - small: ModernBERT L4 H32 A2 I48 V300, sequence 32")
    window = [n for n in plan.notes if n.startswith("sliding-window attention")]
    assert len(window) == 1
    assert "2 of 4 layers attend within 4 tokens each side" in window[0]
    assert "full 32 x 32 scores" in window[0] and "26%" in window[0]  # 268 of 1024 pairs
    assert plan_dict(plan)["model"]["architecture"] == "modernbert"
    every_layer_global = small("model.modernbert.global_attn_every_n_layers=1")
    assert not any("sliding-window" in n for n in plan_run(
        every_layer_global, model=graph_of(every_layer_global)).notes)


def test_every_family_has_a_name() -> None:
    assert set(FAMILIES) == set(ARCHITECTURES)
    assert FAMILIES["modernbert"].title == "ModernBERT"


def test_cli_names_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", "fast", "--set", "model.num_layers=1",
                 "--set", "execution.micro_batch_size=2", "--device", "h100"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("popbert plan - fast: ModernBERT L1 H256")
