"""`popbert export` for fine-tuned tasks, half precision, fixed batches and external data.

Checkpoints here are small random models saved as a fine-tuning run would save them (task
settings in `model.task`, the vocabulary in the config). ONNX Runtime is compared with the
torch backend running the same FP32 graph: 1e-4 absolute in FP32 (see export.VERIFY_ATOL),
export.FP16_TOLERANCE of the output scale in FP16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from checkpoint_helpers import random_task_run, run_ort

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.cli import main as cli
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_vocab_path
from popbert.export import inference as export
from popbert.runtime.session import InferenceSession

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]


def fine_tuned(directory: Path, task: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A run directory with one checkpoint of a random `task` model."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TaskConfig(name=task, lowercase=True, num_labels=3,
                                labels=["neg", "neutral", "pos"], doc_stride=8,
                                max_query_length=8)
    cfg.data.vocab_file = str(bundled_vocab_path())
    return directory, random_task_run(directory, cfg, task, seed=11, step=3)


def torch_reference(task: str, weights: dict[str, np.ndarray], batch) -> dict[str, np.ndarray]:
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TaskConfig(num_labels=3)
    session = InferenceSession(build_bert(cfg.model, task=task, with_loss=False,
                                          zeros=True).model())
    session.load_weights(weights, strict=False)
    return {k: v.numpy() for k, v in session.run(batch).items()}


def batch_of(n: int, seed: int = 5) -> dict[str, np.ndarray]:
    config = load_config("tiny", SMALL).model
    return export.sample_batch(config, "squad", batch_size=n, seed=seed)


@pytest.mark.parametrize("task,outputs", [("squad", ["start_logits", "end_logits"]),
                                          ("classification", ["logits"])])
def test_task_exports_match_the_torch_backend(tmp_path: Path, task: str,
                                              outputs: list[str]) -> None:
    run, weights = fine_tuned(tmp_path / "run", task)
    output = tmp_path / f"{task}.onnx"
    assert cli.main(["export", "--checkpoint", str(run), "--task", task, "--output",
                     str(output), "--dynamic-batch"]) == 0
    model = onnx.load(str(output))
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == outputs
    assert not any(n.op_type == "Dropout" for n in model.graph.node)
    assert any(n.op_type == "Attention" for n in model.graph.node)  # the fused op
    batch = batch_of(3)
    ours, theirs = torch_reference(task, weights, batch), run_ort(output, batch)
    for name in outputs:
        np.testing.assert_allclose(theirs[name], ours[name], atol=1e-4, rtol=0, err_msg=name)
        assert np.abs(ours[name]).max() > 0.01  # not vacuous
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["popbert.task"] == task and meta["popbert.dtype"] == "float32"
    assert meta["popbert.vocab"] == bundled_vocab_path().read_text(encoding="utf-8")
    if task == "squad":
        assert (meta["popbert.doc_stride"], meta["popbert.max_query_length"]) == ("8", "8")
    else:
        assert meta["popbert.labels"] == '["neg", "neutral", "pos"]'


def test_fixed_batch_and_sequence_length(tmp_path: Path) -> None:
    run, weights = fine_tuned(tmp_path / "run", "classification")
    output = tmp_path / "fixed.onnx"
    assert cli.main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                     str(output), "--batch-size", "2", "--sequence-length", "48"]) == 0
    model = onnx.load(str(output))
    dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input]
    assert dims == [[2, 48]] * 3
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    config = load_config("tiny", [*SMALL, "model.sequence_length=48"]).model
    assert session.run(None, export.sample_batch(config, "encoder", batch_size=2))
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        session.run(None, export.sample_batch(config, "encoder", batch_size=3))


def test_float16_export_halves_the_file_and_stays_close(tmp_path: Path) -> None:
    run, weights = fine_tuned(tmp_path / "run", "squad")
    full, half = tmp_path / "fp32.onnx", tmp_path / "fp16.onnx"
    for path, dtype in ((full, "float32"), (half, "float16")):
        assert cli.main(["export", "--checkpoint", str(run), "--task", "squad", "--output",
                         str(path), "--dtype", dtype]) == 0
    model = onnx.load(str(half))
    floats = {t.data_type for t in model.graph.initializer
              if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    assert floats == {onnx.TensorProto.FLOAT16}
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {
        onnx.TensorProto.FLOAT16}
    assert half.stat().st_size < 0.6 * full.stat().st_size
    batch = batch_of(4, seed=9)
    ours, theirs = torch_reference("squad", weights, batch), run_ort(half, batch)
    for name, value in theirs.items():
        assert value.dtype == np.float16
        scale = max(1.0, float(np.abs(ours[name]).max()))
        assert np.abs(value.astype(np.float32) - ours[name]).max() <= \
            export.FP16_TOLERANCE * scale


def test_external_data_above_the_threshold(tmp_path: Path) -> None:
    run, weights = fine_tuned(tmp_path / "run", "squad")
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    export.export_checkpoint(run, "squad", inline)
    export.export_checkpoint(run, "squad", external, external_data_threshold=1)
    data = tmp_path / "external.onnx.data"
    assert data.is_file() and not (tmp_path / "inline.onnx.data").exists()
    assert external.stat().st_size < 0.2 * inline.stat().st_size
    assert data.stat().st_size > 0.8 * inline.stat().st_size
    onnx.checker.check_model(str(external), full_check=True)
    batch = batch_of(2)
    a, b = run_ort(inline, batch), run_ort(external, batch)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # Exporting again below the threshold removes the now stale data file.
    export.export_checkpoint(run, "squad", external)
    assert not data.exists()
    np.testing.assert_array_equal(run_ort(external, batch)["start_logits"], a["start_logits"])


def test_a_failed_check_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, _ = fine_tuned(tmp_path / "run", "classification")
    real = export.ort_outputs

    def drifting(source, batch):
        return {k: v + 1e-3 for k, v in real(source, batch).items()}

    monkeypatch.setattr(export, "ort_outputs", drifting)
    output = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError, match="'logits' differs"):
        export.export_checkpoint(run, "classification", output)
    assert not output.exists()


def test_user_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = fine_tuned(tmp_path / "run", "classification")
    for argv, fragments in [
        (["--task", "squad"], ["no weights for the squad graph", "Squad/Logits/W"]),
        (["--task", "encoder", "--sequence-length", "100"],
         ["--sequence-length", "max_position_embeddings (64)"]),
        (["--task", "encoder", "--batch-size", "0"], ["--batch-size must be >= 1"]),
    ]:
        code = cli.main(["export", "--checkpoint", str(run), "--output",
                         str(tmp_path / "x.onnx"), *argv])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, lines
        assert all(f in lines[0] for f in fragments), lines[0]
        assert not (tmp_path / "x.onnx").exists()
    # --dynamic-batch and --batch-size exclude each other (argparse usage error).
    assert cli.main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                     str(tmp_path / "x.onnx"), "--dynamic-batch", "--batch-size", "2"]) == 2


@pytest.mark.parametrize("threshold", [export.EXTERNAL_DATA_THRESHOLD, 1],
                         ids=["inline", "external-data"])
def test_a_full_disk_is_one_line_naming_the_export(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   threshold: int) -> None:
    """`popbert export` onto a full disk: a WriteError naming the output (not onnx's or the
    OS's traceback), and no file or temporary left behind (issue 20, item 2)."""
    import errno
    import os

    from popbert import atomic
    from popbert.errors import WriteError

    run, _ = fine_tuned(tmp_path / "run", "squad")
    output = tmp_path / "out" / "squad.onnx"
    output.parent.mkdir()

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_create", full)
    monkeypatch.setattr(export.onnx, "save_model", full)
    with pytest.raises(WriteError, match=f"^{output}: cannot write: No space left on device$"):
        export.export_checkpoint(run, "squad", output, external_data_threshold=threshold)
    assert list(output.parent.iterdir()) == []
