"""`popbert export --runtime openvino` and `popbert predict` on an OpenVINO IR.

The IR is converted by OpenVINO's own converter from the FP32 ONNX export and checked at export
time against the torch backend, like every export. At f32 the tolerance is the ONNX export's
(1e-4 of the largest output); at bf16 it is 6e-2 of it (BF16 keeps 8 significant bits; measured
3e-3 on these models), far below the O(1) a wrong weight makes. Here the IR is also held against
what we did not write into it: ONNX Runtime running the plain FP32 export, on real rows, through
`popbert predict` (same labels, same order), and the export check must refuse a model whose
references come from other weights (the negative control). Skipped only where OpenVINO cannot
be installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoint_helpers import random_task_run

from popbert.cli.main import main
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_vocab_path

pytest.importorskip("openvino")

FIXTURES = Path(__file__).parent.parent / "fixtures"
SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"
SQUAD = FIXTURES / "squad" / "squad-v1.1-sample.json"
SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=48",
         "model.max_position_embeddings=64"]


def task_config(task: str, preset: str = "tiny", extra: tuple = ()):
    cfg = load_config(preset, [*SMALL, *extra])
    if task == "classification":
        cfg.model.task = TaskConfig(name=task, lowercase=True, num_labels=2, labels=["0", "1"])
    elif task == "squad":
        cfg.model.task = TaskConfig(name=task, lowercase=True, doc_stride=16,
                                    max_query_length=12)
    cfg.data.vocab_file = str(bundled_vocab_path())
    return cfg


def task_run(directory: Path, task: str, preset: str = "tiny", extra: tuple = (),
             seed: int = 7) -> Path:
    random_task_run(directory, task_config(task, preset, extra), task, seed=seed)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("openvino")
    return {task: task_run(root / task, task) for task in ("classification", "squad")}


def export(run: Path, task: str, output: Path, *extra: str) -> int:
    return main(["export", "--checkpoint", str(run), "--task", task, "--output", str(output),
                 *extra])


@pytest.mark.parametrize("task", ["pretraining", "encoder", "classification", "squad"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_every_task_exports_and_is_checked(task: str, precision: str, tmp_path: Path,
                                           runs: dict[str, Path], caplog) -> None:
    run = runs.get(task) or task_run(tmp_path / "run", task)
    output = tmp_path / "ir"
    with caplog.at_level("INFO"):
        assert export(run, task, output, "--runtime", "openvino", "--precision",
                      precision) == 0
    assert sorted(p.name for p in output.iterdir()) == ["model.bin", "model.xml"]
    line = next(r.getMessage() for r in caplog.records if "OpenVINO IR" in r.getMessage())
    assert f"precision {precision}" in line and "matches the torch backend" in line
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_modernbert_exports_too(tmp_path: Path) -> None:
    """The family seam: rotary positions, GeGLU and the sliding window convert as well."""
    run = task_run(tmp_path / "run", "encoder", "fast",
                   ("model.modernbert.local_attention=16", "model.num_heads=2"))
    assert export(run, "encoder", tmp_path / "ir", "--runtime", "openvino", "--precision",
                  "f32") == 0


@pytest.mark.parametrize("preset, extra", [
    ("tiny", ()),
    ("fast", ("model.modernbert.local_attention=16", "model.num_heads=2")),
], ids=["bert", "modernbert"])
def test_the_runtime_rewrite_changes_no_output(preset: str, extra: tuple,
                                               tmp_path: Path) -> None:
    """`convert` splits the fused projections and drops the NaN guards after attention (for
    OpenVINO's speed); the outputs must be the converter's own model's, on rows with padding,
    and nothing of either pattern may be left."""
    import openvino as ov

    from popbert.export.inference import export_checkpoint
    from popbert.export.openvino import convert
    from popbert.serve.openvino_ir import compile_model, run

    run_dir = task_run(tmp_path / "run", "encoder", preset, extra)
    source = export_checkpoint(run_dir, "encoder", tmp_path / "m.onnx")
    plain = ov.convert_model(str(source))
    types = [op.get_type_name() for op in plain.get_ordered_ops()]
    assert "IsNaN" in types and "Split" in types  # the patterns are there to remove
    rewritten = convert(source)
    left = [op for op in rewritten.get_ordered_ops() if op.get_type_name() in ("IsNaN", "Split")
            and op.input_value(0).get_node().get_type_name() in ("MatMul", "Add",
                                                               "ScaledDotProductAttention")]
    assert left == []
    rng = np.random.default_rng(0)
    names = {i.get_any_name() for i in plain.inputs}
    feeds = {"input_ids": rng.integers(5, 100, (3, 40)), "input_mask": np.ones((3, 40)),
             "segment_ids": np.zeros((3, 40))}
    feeds["input_mask"][1, 9:] = 0
    feeds = {k: v.astype(np.int64) for k, v in feeds.items() if k in names}
    expected = run(compile_model(plain, "f32"), feeds)
    got = run(compile_model(rewritten, "f32"), feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * np.abs(value).max())


def predictions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_predict_on_the_ir_equals_predict_on_the_onnx_export(
        precision: str, runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["classification"]
    assert export(run, "classification", tmp_path / "m.onnx") == 0
    assert export(run, "classification", tmp_path / "ir", "--runtime", "openvino",
                  "--precision", precision) == 0
    for model in ("m.onnx", "ir"):
        assert main(["predict", "classify", "--model", str(tmp_path / model), "--data",
                     str(SENTIMENT), "-o", str(tmp_path / f"{model}.jsonl")]) == 0
    ours, theirs = predictions(tmp_path / "ir.jsonl"), predictions(tmp_path / "m.onnx.jsonl")
    assert [r["label"] for r in ours] == [r["label"] for r in theirs]
    probabilities = np.array([[r["probabilities"][k] for k in sorted(r["probabilities"])]
                              for r in ours])
    reference = np.array([[r["probabilities"][k] for k in sorted(r["probabilities"])]
                          for r in theirs])
    np.testing.assert_allclose(probabilities, reference,
                               atol=1e-5 if precision == "f32" else 2e-2)
    # Served as predict serves it, its threads are not pinned: OpenVINO pins from the first
    # core on, so `popbert serve --workers 2 --threads 1` ran both workers on one core.
    from popbert.serve.openvino_ir import compile_model, ir_file, openvino
    network = openvino().Core().read_model(str(ir_file(tmp_path / "ir")))
    assert compile_model(network, precision, 1).get_property("ENABLE_CPU_PINNING") is False


def test_squad_predictions_equal_too(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["squad"]
    assert export(run, "squad", tmp_path / "m.onnx") == 0
    assert export(run, "squad", tmp_path / "ir", "--runtime", "openvino", "--precision",
                  "f32") == 0
    for model in ("m.onnx", "ir"):
        assert main(["predict", "squad", "--model", str(tmp_path / model), "--data",
                     str(SQUAD), "-o", str(tmp_path / f"{model}.json")]) == 0
    assert json.loads((tmp_path / "ir.json").read_text()) == \
        json.loads((tmp_path / "m.onnx.json").read_text())


def test_the_check_refuses_other_weights(runs: dict[str, Path], tmp_path: Path) -> None:
    """Negative control: references from a model with other weights fail the IR's check."""
    import onnx

    from popbert.export.inference import export_checkpoint, sample_batch, torch_outputs
    from popbert.export.openvino import write_ir

    other = task_run(tmp_path / "other", "classification", seed=99)
    mine = export_checkpoint(runs["classification"], "classification", tmp_path / "mine.onnx")
    theirs = export_checkpoint(other, "classification", tmp_path / "theirs.onnx")
    batch = sample_batch(task_config("classification").model, "classification", batch_size=2)
    assert write_ir(mine, tmp_path / "ok", "f32", [batch],
                    [torch_outputs(onnx.load(str(mine)), batch)]) < 1e-4
    with pytest.raises(RuntimeError, match="differs between OpenVINO"):
        write_ir(mine, tmp_path / "wrong", "f32", [batch],
                 [torch_outputs(onnx.load(str(theirs)), batch)])
    assert not (tmp_path / "wrong").exists()


def test_the_accuracy_guard_works_on_the_ir(runs: dict[str, Path], tmp_path: Path,
                                            caplog) -> None:
    with caplog.at_level("INFO"):
        assert export(runs["classification"], "classification", tmp_path / "ir", "--runtime",
                      "openvino", "--precision", "bf16", "--eval", str(SENTIMENT),
                      "--max-accuracy-drop", "50") == 0
    line = next(r.getMessage() for r in caplog.records if "accuracy cost" in r.getMessage())
    assert "agreement with FP32" in line and (tmp_path / "ir" / "model.xml").is_file()


@pytest.mark.parametrize("flags,message", [
    (["--quantize", "int8", "--keep-float", "head"], "--keep-float writes ONNX Runtime's"),
    (["--dtype", "float16"], "--dtype float16 writes ONNX Runtime's operators"),
    (["--quantize", "int8"], "give --calibration FILE (the checkpoint names no training file)"),
])
def test_what_the_ir_export_refuses(flags: list[str], message: str,
                                          runs: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert export(runs["classification"], "classification", tmp_path / "ir", "--runtime",
                  "openvino", *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "ir").exists()


def test_without_openvino_one_line_says_how_to_install(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    capsys.readouterr()
    assert export(runs["classification"], "classification", tmp_path / "ir", "--runtime",
                  "openvino") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["popbert: error: OpenVINO is not installed: "
                   "pip install 'popbert[openvino]'"]
    assert not (tmp_path / "ir").exists()


WORDS = "the film was long and far too slow good bad fine an pleasant afternoon cinema".split()


def test_static_int8_and_a_wrong_calibration_file_refused(tmp_path: Path, capsys) -> None:
    """NNCF's static INT8 (`--quantize int8`), calibrated on the user's rows, and the negative
    control: the classifier's bias is moved by the median logit margin of a random model, so
    its labels sit on a knife's edge (margins within a few 1e-3) and quantization noise flips
    some; calibrated on the texts themselves about 12% change, calibrated on rows of "!" alone
    (activation ranges of nothing like them) half do, and the guard refuses that export."""
    import torch

    from popbert.config import dump_config
    from popbert.export.inference import export_checkpoint
    from popbert.io.checkpoint import Checkpoint, save_checkpoint
    from popbert.serve.predict import ClassifyPredictor, read_texts

    cfg = task_config("classification")
    weights = random_task_run(tmp_path / "random", cfg, "classification", seed=5)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)]
                                        for j in range(3 + i % 18)) for i in range(60)) + "\n")
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("!\n" * 20)
    reference = export_checkpoint(tmp_path / "random", "classification", tmp_path / "fp32.onnx")
    p = ClassifyPredictor(reference).probabilities(read_texts(texts))
    bias = np.array(weights["Classifier/B"], copy=True)
    bias[1] -= float(np.median(np.log(p[:, 1] / p[:, 0])))
    weights["Classifier/B"] = bias
    save_checkpoint(tmp_path / "edge" / "checkpoints" / "step-000001",
                    Checkpoint(step=1, weights={k: torch.from_numpy(np.asarray(v))
                                                for k, v in weights.items()}), dump_config(cfg))

    def int8(calibration: Path, output: str) -> int:
        return export(tmp_path / "edge", "classification", tmp_path / output, "--runtime",
                      "openvino", "--quantize", "int8", "--calibration", str(calibration),
                      "--eval", str(texts), "--max-accuracy-drop", "30")

    assert int8(texts, "good") == 0 and (tmp_path / "good" / "model.xml").is_file()
    assert main(["predict", "classify", "--model", str(tmp_path / "good"), "--data",
                 str(texts), "-o", str(tmp_path / "p.jsonl")]) == 0
    capsys.readouterr()
    assert int8(wrong, "bad") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("popbert")]
    assert len(err) == 1 and "30" in err[0], err
    assert not (tmp_path / "bad").exists()


def test_calibration_defaults_to_the_training_file(tmp_path: Path, caplog,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = task_config("classification")
    # as `popbert finetune classify --checkpoint ... --train ...` stores them
    cfg.finetune.task, cfg.finetune.train_file = "classification", str(SENTIMENT)
    cfg.finetune.checkpoint = str(tmp_path / "pre-trained")
    random_task_run(tmp_path / "run", cfg, "classification", seed=3)
    with caplog.at_level("INFO"):
        assert export(tmp_path / "run", "classification", tmp_path / "ir", "--runtime",
                      "openvino", "--quantize", "int8") == 0
    assert any(f"first 300 rows of {SENTIMENT}" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert export(tmp_path / "run", "classification", tmp_path / "m.onnx", "--calibration",
                  str(SENTIMENT)) == 2  # ONNX Runtime's INT8 calibrates nothing
    assert "--calibration applies to --runtime openvino" in capsys.readouterr().err
