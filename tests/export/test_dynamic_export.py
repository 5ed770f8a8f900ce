"""Inference graphs with a symbolic sequence axis, and the exports built from them.

`build_bert(..., dynamic_sequence=True)` must compute, at every length, what the static graph
built for that length computes (same weights), in the torch backend and in ONNX Runtime; the
training graphs and the popart dialect keep their static shapes. `popbert export` writes such
graphs by default and checks them at two batch sizes and two lengths; `--optimize` runs ONNX
Runtime's transformer optimizer on the file and is checked the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from checkpoint_helpers import random_task_run, run_ort

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import BATCH, SEQUENCE, build_bert
from popbert.cli import main as cli
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_vocab_path
from popbert.export import inference as export

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
GROUPBERT = ["model.architecture=groupbert", "model.groupbert.ffn_groups=4",
             "model.groupbert.conv_group_size=8", "model.groupbert.conv_kernel_size=7"]


def config(*extra: str):
    model = load_config("tiny", [*SMALL, *extra]).model
    model.task = TaskConfig(num_labels=3)
    return model


def input_dims(model: onnx.ModelProto) -> list[list[int | str]]:
    return [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input]


@pytest.mark.parametrize("extra,task", [([], "pretraining"), (GROUPBERT, "squad")])
def test_a_symbolic_length_computes_what_the_static_graph_does(extra, task) -> None:
    cfg = export.inference_config(config(*extra))
    dynamic = build_bert(cfg, task=task, with_loss=False, seed=4, dynamic_sequence=True)
    model = dynamic.model()
    assert dynamic.sequence_length == SEQUENCE
    assert all(dims[:2] == [BATCH, SEQUENCE] for dims in input_dims(model)[:3])
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for length, rows in ((32, 2), (11, 3), (64, 1)):  # 64: max_position_embeddings
        static = build_bert(export.inference_config(cfg, length), task=task, with_loss=False,
                            seed=4).model()
        batch = export.sample_batch(cfg, task, batch_size=rows, seed=length,
                                    sequence_length=length)
        expected = export.torch_outputs(static, batch)
        ours = export.torch_outputs(model, batch)
        theirs = dict(zip(names, session.run(None, batch)))
        for name, value in expected.items():
            assert value.shape[0] == rows
            np.testing.assert_allclose(ours[name], value, rtol=0, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(theirs[name], value, rtol=0, atol=1e-4, err_msg=name)
            assert np.abs(value).max() > 1e-3  # not vacuous


def test_training_graphs_stay_static_unless_asked_and_the_popart_dialect_always() -> None:
    cfg = config()
    training = build_bert(cfg, task="pretraining", zeros=True).model()
    assert all(dims[1] == 32 for dims in input_dims(training)[:3])
    assert not any(n.op_type in ("Shape", "Slice") for n in training.graph.node)
    popart = load_config("tiny", [*SMALL, "model.dialect=popart"]).model
    with pytest.raises(ValueError, match="dynamic_sequence is for onnx-dialect graphs"):
        build_bert(popart, batch_size=2, zeros=True, dynamic_sequence=True)


def fine_tuned(directory: Path) -> Path:
    """A run directory with one checkpoint of a random classification model."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TaskConfig(name="classification", lowercase=True, num_labels=3,
                                labels=["a", "b", "c"])
    cfg.data.vocab_file = str(bundled_vocab_path())
    random_task_run(directory, cfg, "classification", seed=7, step=2)
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fine_tuned(tmp_path_factory.mktemp("dynamic") / "run")


def test_export_is_dynamic_by_default_and_optimize_keeps_the_outputs(run: Path,
                                                                     tmp_path: Path) -> None:
    plain, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    for path, extra in ((plain, []), (fused, ["--optimize"])):
        assert cli.main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                         str(path), *extra]) == 0
    models = {path: onnx.load(str(path)) for path in (plain, fused)}
    for model in models.values():
        assert input_dims(model) == [[BATCH, SEQUENCE]] * 3
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["popbert.sequence_length"] == "32" and meta["popbert.task"] == "encoder"
    meta = {p.key: p.value for p in models[fused].metadata_props}
    assert "EmbedLayerNormalization" in meta["popbert.fusions"]
    ops = [{n.op_type for n in model.graph.node} for model in models.values()]
    assert "EmbedLayerNormalization" in ops[1] and "EmbedLayerNormalization" not in ops[0]
    cfg = config()
    for rows, length in ((1, 64), (5, 9)):
        batch = export.sample_batch(cfg, "encoder", rows, seed=rows, sequence_length=length)
        a, b = run_ort(plain, batch), run_ort(fused, batch)
        assert a["last_hidden_state"].shape == (rows, length, 32)
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-4, err_msg=name)


def test_the_check_covers_the_second_shape(run: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real = export.ort_outputs
    seen = []

    def wrong_at_3x17(source, batch):
        outputs = real(source, batch)
        seen.append(batch["input_ids"].shape)
        if batch["input_ids"].shape == (3, 17):  # the second shape of a dynamic export
            return {k: v + 1e-2 for k, v in outputs.items()}
        return outputs

    monkeypatch.setattr(export, "ort_outputs", wrong_at_3x17)
    output = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError, match="'logits' differs"):
        export.export_checkpoint(run, "classification", output)
    assert not output.exists()
    assert seen == [(2, 32), (3, 17)]
    seen.clear()
    export.export_checkpoint(run, "classification", output, sequence_length=20,
                             batch_size=4)
    assert seen == [(4, 20)]
    assert input_dims(onnx.load(str(output))) == [[4, 20]] * 3


def test_optimize_refuses_float16(run: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                     str(tmp_path / "x.onnx"), "--optimize", "--dtype", "float16"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--optimize" in lines[0], lines
    assert not (tmp_path / "x.onnx").exists()
