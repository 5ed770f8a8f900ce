"""`popbert export --optimize` (ONNX Runtime's fused BERT operators) and `--quantize int8`.

Every graph is checked here against the torch backend running the standard FP32 graph, on a
batch the export's own check did not see (one row half padding):
- fused: 1e-4 absolute, export.VERIFY_ATOL: the fused kernels only reorder FP32 sums;
- INT8: RMS difference <= 0.05 of an output's RMS (at least 1). Dynamic INT8 of these small
  random models moves outputs by 0.1-0.5% of their RMS; export.INT8_TOLERANCE (0.5) is for
  real checkpoints whose activations have outliers. A wrong weight moves them by ~100%.
Weights are random with non-zero biases and norms, so a fusion that drops or misplaces one
changes the outputs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from checkpoint_helpers import run_ort

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import BATCH, build_bert
from popbert.builders.bert_config import BertConfig
from popbert.errors import UsageError
from popbert.export import fused, quantize
from popbert.export import inference as export
from popbert.graph.annotations import strip_annotations
from popbert.runtime.session import InferenceSession

LAYERS = 2
OUTPUTS = {"encoder": ["last_hidden_state", "pooler_output"],
           "pretraining": ["mlm_logits", "nsp_logits"],
           "classification": ["logits"], "squad": ["start_logits", "end_logits"]}


def small_config(architecture: str) -> BertConfig:
    config = BertConfig(vocab_size=500, hidden_size=64, num_heads=4, num_layers=LAYERS,
                        intermediate_size=128, sequence_length=24, max_position_embeddings=48,
                        max_predictions_per_seq=4, architecture=architecture)
    config.task.num_labels = 3
    return config


def fused_attentions(architecture: str, task: str) -> int:
    """The layers whose attention ONNX Runtime's fused kernel (`Attention`, `QAttention`)
    takes: all but a BERT classifier's last, which computes [CLS] alone (a one-row query the
    fused op cannot express: it stays the standard `Attention` op, its matmuls quantized)."""
    return LAYERS - 1 if (architecture, task) == ("bert", "classification") else LAYERS


def random_weights(config: BertConfig, task: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial weights plus noise: biases, LayerNorm gains and offsets all away from 0 and 1."""
    model = build_bert(config, task=task, with_loss=False, seed=seed).model()
    rng = np.random.default_rng(seed)
    return {t.name: (onnx.numpy_helper.to_array(t)
                     + rng.normal(0, 0.1, tuple(t.dims))).astype(np.float32)
            for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}


def torch_reference(config: BertConfig, task: str, weights, batch) -> dict[str, np.ndarray]:
    graph = build_bert(export.inference_config(config), task=task, with_loss=False, zeros=True,
                       batch_size=BATCH, dynamic_sequence=True).model()
    session = InferenceSession(strip_annotations(export.with_weights(graph, weights)))
    return {k: v.float().numpy() for k, v in session.run(batch).items()}


def unseen_batch(config: BertConfig, task: str) -> dict[str, np.ndarray]:
    return export.sample_batch(config, task, batch_size=4, seed=99, sequence_length=19)


def op_counts(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("task", list(OUTPUTS))
def test_fused_export_runs_ort_kernels_and_matches_the_torch_backend(
        tmp_path: Path, architecture: str, task: str) -> None:
    config = small_config(architecture)
    weights = random_weights(config, task)
    path = export.export_weights(weights, config, task, tmp_path / "fused.onnx",
                                 fusions=fused.ALL_FUSIONS)
    ops = op_counts(path)
    residuals = 2 if architecture == "bert" else 4  # per layer: post-norm BERT, GroupBERT
    ffns = 1 if architecture == "bert" else 2
    assert ops["Attention"] == LAYERS and ops["EmbedLayerNormalization"] == 1
    assert ops["SkipLayerNormalization"] == residuals * LAYERS
    assert ops["BiasGelu"] >= ffns * LAYERS
    model = onnx.load(str(path))
    domains = Counter(n.domain for n in model.graph.node if n.op_type == "Attention")
    assert domains["com.microsoft"] == fused_attentions(architecture, task)
    assert domains[""] == LAYERS - fused_attentions(architecture, task)
    assert not any(n.op_type == "Gelu" for n in model.graph.node)
    meta = {p.key: p.value for p in model.metadata_props}
    assert "SkipLayerNormalization" in meta["popbert.fusions"]
    batch = unseen_batch(config, task)
    ours, theirs = torch_reference(config, task, weights, batch), run_ort(path, batch)
    for name in OUTPUTS[task]:
        scale = max(1.0, float(np.abs(ours[name]).max()))
        np.testing.assert_allclose(theirs[name], ours[name], rtol=0,
                                   atol=export.VERIFY_ATOL * scale, err_msg=name)
        assert np.abs(ours[name]).max() > 0.01  # not vacuous


def test_a_wrong_fusion_is_caught_by_the_export_check(tmp_path: Path, monkeypatch) -> None:
    """Negative control: SkipLayerNormalization without the dense layer's bias must fail the
    check, and leave no file behind."""
    original = fused._fuse_skip_norms

    def drop_bias(graph) -> None:
        original(graph)
        for nodes in graph.added.values():
            for node in nodes:
                if node.op_type == "SkipLayerNormalization" and len(node.input) == 5:
                    del node.input[4]

    monkeypatch.setitem(fused.REWRITES, "SkipLayerNormalization", drop_bias)
    config = small_config("bert")
    with pytest.raises(RuntimeError, match="export check failed"):
        export.export_weights(random_weights(config, "encoder"), config, "encoder",
                              tmp_path / "wrong.onnx", fusions=fused.ALL_FUSIONS)
    assert not (tmp_path / "wrong.onnx").exists()


def test_fusions_can_be_chosen() -> None:
    config = export.inference_config(small_config("bert"))
    graph = strip_annotations(build_bert(config, task="encoder", with_loss=False,
                                         batch_size=BATCH, dynamic_sequence=True).model())
    model, counts = fused.fuse_for_ort(graph, config.num_heads, fusions=("BiasGelu",))
    assert counts == {"BiasGelu": LAYERS, "Sum": 1 + 2 * LAYERS}  # embeddings + residuals
    assert Counter(n.op_type for n in model.graph.node)["LayerNormalization"] == 1 + 2 * LAYERS
    with pytest.raises(ValueError, match="unknown fusions"):
        fused.fuse_for_ort(graph, config.num_heads, fusions=("Flash",))


@pytest.mark.parametrize("architecture,task,fusions", [
    ("bert", "classification", None), ("bert", "squad", fused.ALL_FUSIONS),
    ("bert", "pretraining", None), ("groupbert", "encoder", None)])
def test_int8_export_matches_the_torch_backend(tmp_path: Path, architecture: str, task: str,
                                               fusions) -> None:
    config = small_config(architecture)
    weights = random_weights(config, task)
    path = export.export_weights(weights, config, task, tmp_path / "int8.onnx",
                                 fusions=fusions, quantize="int8")
    model = onnx.load(str(path))
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulInteger"] >= 2 * LAYERS
    assert ops["QAttention"] == fused_attentions(architecture, task)
    integer = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert integer and not any("Embedding" in name for name in integer)
    # The default keeps the task heads in FP32: their weights are still float MatMul inputs
    # (and GroupBERT's grouped FFN weights, 3-D, which ORT's per-channel INT8 cannot take).
    head = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"
            and n.input[1] in weights and weights[n.input[1]].ndim == 2}
    assert head and all(quantize.weight_role(w) == quantize.HEAD for w in head)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["popbert.task"] == task and "qkv" in meta["popbert.quantized"]
    batch = unseen_batch(config, task)
    ours, theirs = torch_reference(config, task, weights, batch), run_ort(path, batch)
    for name in OUTPUTS[task]:
        difference = np.sqrt(np.mean(np.square(theirs[name] - ours[name])))
        rms = max(1.0, float(np.sqrt(np.mean(np.square(ours[name])))))
        assert 0 < difference / rms <= 0.05, name  # quantized (not exact), and close


def test_keep_float_roles_and_a_corrupt_int8_weight(tmp_path: Path, monkeypatch) -> None:
    config = small_config("bert")
    weights = random_weights(config, "encoder")
    everything = export.export_weights(weights, config, "encoder", tmp_path / "all.onnx",
                                       quantize="int8", keep_float=())
    kept = export.export_weights(weights, config, "encoder", tmp_path / "kept.onnx",
                                 quantize="int8", keep_float=("ffn-out", "head"))
    # QKV in QAttention; attention-out, ffn-in, ffn-out in MatMulInteger; + the pooler.
    assert op_counts(everything)["MatMulInteger"] == 3 * LAYERS + 1
    assert op_counts(everything)["QAttention"] == op_counts(kept)["QAttention"] == LAYERS
    assert op_counts(kept)["MatMulInteger"] == 2 * LAYERS
    # Negative control: an INT8 weight scaled wrongly must fail the export's INT8 check.
    real = quantize.quantize_int8

    def corrupt(model, keep_float, per_channel=True):
        model, counts = real(model, keep_float, per_channel)
        for tensor in model.graph.initializer:
            if tensor.name.endswith("FF/2/W_scale"):
                scale = onnx.numpy_helper.to_array(tensor) * 8
                tensor.CopyFrom(onnx.numpy_helper.from_array(scale, tensor.name))
        return model, counts

    monkeypatch.setattr(export, "quantize_int8", corrupt)
    with pytest.raises(RuntimeError, match="relative RMS"):
        export.export_weights(weights, config, "encoder", tmp_path / "bad.onnx",
                              quantize="int8")
    assert not (tmp_path / "bad.onnx").exists()


def test_quantize_misuse_is_one_line(tmp_path: Path) -> None:
    config = small_config("bert")
    weights = random_weights(config, "encoder")
    with pytest.raises(UsageError, match="--quantize int8 quantizes a float32 graph"):
        export.export_weights(weights, config, "encoder", tmp_path / "a.onnx",
                              dtype="float16", quantize="int8")
    with pytest.raises(UsageError, match="--keep-float applies to quantized exports"):
        export.export_weights(weights, config, "encoder", tmp_path / "a.onnx",
                              keep_float=("head",))
    with pytest.raises(UsageError, match="--quantize: expected one of int8"):
        export.export_weights(weights, config, "encoder", tmp_path / "a.onnx",
                              quantize="int4")


def ort_loaded_ops(path: Path, tmp_path: Path) -> Counter:
    """The operators ONNX Runtime runs after its own load-time fusions (ORT_ENABLE_ALL)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "loaded.onnx")).graph.node)


def test_cpu_fusions_keep_ort_off_its_slow_skip_layer_norm(tmp_path: Path, monkeypatch) -> None:
    """The default (CPU) fusions write residuals as `Sum`, so ONNX Runtime does not fuse them
    into SkipLayerNormalization when it loads an INT8 file; negative control: with plain
    `Add`s it does."""
    config = small_config("bert")
    weights = random_weights(config, "classification")
    default = export.export_weights(weights, config, "classification", tmp_path / "a.onnx",
                                    quantize="int8")
    written = op_counts(default)
    assert written["EmbedLayerNormalization"] == 1 and written["Sum"] == 2 * LAYERS
    loaded = ort_loaded_ops(default, tmp_path)
    assert loaded["SkipLayerNormalization"] == 0
    assert loaded["QAttention"] == fused_attentions("bert", "classification")
    monkeypatch.setattr(fused, "residuals_apart", lambda model: (model, 0))
    adds = export.export_weights(weights, config, "classification", tmp_path / "b.onnx",
                                 quantize="int8")
    # two per layer of every row (ORT leaves the [CLS]-only last layer's residuals alone)
    assert ort_loaded_ops(adds, tmp_path)["SkipLayerNormalization"] == \
        2 * fused_attentions("bert", "classification")


def test_fixed_shape_exports_fuse_too(tmp_path: Path) -> None:
    """A fixed sequence axis reads positions by a constant Gather, not a Slice: fused alike."""
    config = small_config("bert")
    weights = random_weights(config, "squad")
    path = export.export_weights(weights, config, "squad", tmp_path / "fixed.onnx",
                                 batch_size=4, sequence_length=19, fusions=fused.ALL_FUSIONS)
    ops = op_counts(path)
    assert ops["EmbedLayerNormalization"] == 1 and ops["Attention"] == LAYERS
    assert ops["SkipLayerNormalization"] == 2 * LAYERS
    batch = unseen_batch(config, "squad")
    ours, theirs = torch_reference(config, "squad", weights, batch), run_ort(path, batch)
    for name in OUTPUTS["squad"]:
        scale = max(1.0, float(np.abs(ours[name]).max()))
        np.testing.assert_allclose(theirs[name], ours[name], rtol=0,
                                   atol=export.VERIFY_ATOL * scale, err_msg=name)
