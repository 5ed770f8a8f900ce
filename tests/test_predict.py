"""`popbert predict squad`: ONNX Runtime alone answers questions like the training path does.

A small random squad model (exported with its vocabulary and window sizes in the ONNX metadata)
answers the SQuAD fixture; the answers are arbitrary but must be exactly those the torch path
(popbert.data.squad features → InferenceSession → the same decoding) gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import popbert.builders.tasks  # noqa: F401
from popbert.builders.bert import build_bert
from popbert.cli import main as cli
from popbert.config import TaskConfig, dump_config, load_config
from popbert.data.squad import WindowOptions, decode_answers, read_squad, squad_features
from popbert.data.tokenization import bundled_vocab_path, make_tokenizer, parse_vocab
from popbert.graph.annotations import trainable_initializers
from popbert.io.checkpoint import Checkpoint, save_checkpoint
from popbert.runtime.session import InferenceSession
from popbert.serve.predict import SquadPredictor

FIXTURE = Path(__file__).parent / "fixtures" / "squad" / "squad-v1.1-sample.json"
SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=40",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
TASK = TaskConfig(name="squad", lowercase=True, doc_stride=8, max_query_length=12)


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory holding a random squad model, as `popbert finetune squad` writes it."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TASK
    cfg.data.vocab_file = str(bundled_vocab_path())
    model = build_bert(cfg.model, task="squad", seed=3).model()
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = {n: torch.from_numpy(values[n] * 3) for n in trainable_initializers(model)}
    run = tmp_path_factory.mktemp("squad") / "run"
    save_checkpoint(run / "checkpoints" / "step-000001", Checkpoint(step=1, weights=weights),
                    dump_config(cfg))
    return run, weights


@pytest.fixture(scope="module")
def exported(squad_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("onnx") / "squad.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "squad",
                     "--output", str(output)]) == 0
    return output


def torch_predictions(weights, n_best_size: int = 20):
    """The training side: popbert.data.squad features, torch backend logits, same decoding."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = TASK
    vocab = parse_vocab(bundled_vocab_path().read_text(encoding="utf-8"))
    questions, _ = read_squad(FIXTURE)
    features = squad_features(questions, make_tokenizer(vocab), vocab,
                              WindowOptions(40, TASK.doc_stride, TASK.max_query_length))
    session = InferenceSession(build_bert(cfg.model, task="squad", with_loss=False,
                                          zeros=True).model())
    session.load_weights(weights, strict=False)
    logits = session.run(features.arrays)
    return decode_answers(questions, features.windows, logits["start_logits"].numpy(),
                          logits["end_logits"].numpy(), n_best_size, 30)


def test_predict_imports_no_torch(exported: Path, tmp_path: Path) -> None:
    output = tmp_path / "predictions.json"
    code = (
        "import sys\n"
        "from popbert.cli.main import main\n"
        f"rc = main(['predict', 'squad', '--model', {str(exported)!r}, '--data', "
        f"{str(FIXTURE)!r}, '--output', {str(output)!r}])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
        "sys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    predictions = json.loads(output.read_text())
    questions, _ = read_squad(FIXTURE)
    assert list(predictions) == [q.id for q in questions]
    nbest = json.loads((tmp_path / "nbest_predictions.json").read_text())
    for qid, answer in predictions.items():
        assert nbest[qid][0]["text"] == answer
        assert answer in questions[0].context + questions[2].context


def test_onnx_runtime_answers_exactly_like_the_torch_path(squad_run, exported: Path) -> None:
    questions, _ = read_squad(FIXTURE)
    served, served_nbest = SquadPredictor(exported).predict(questions)
    expected, expected_nbest = torch_predictions(squad_run[1])
    assert served == expected
    for qid, candidates in expected_nbest.items():
        assert [c.text for c in served_nbest[qid]] == [c.text for c in candidates]
        np.testing.assert_allclose([c.probability for c in served_nbest[qid]],
                                   [c.probability for c in candidates], atol=1e-4)
    assert len(set(served.values())) > 1  # not vacuous: different questions, different spans


def test_a_fixed_batch_export_is_padded_per_run(squad_run, exported: Path,
                                                tmp_path: Path) -> None:
    fixed = tmp_path / "fixed.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "squad",
                     "--output", str(fixed), "--batch-size", "7"]) == 0
    predictor = SquadPredictor(fixed)
    assert predictor.batch_size == 7 and predictor.sequence_length == 40
    questions, _ = read_squad(FIXTURE)
    assert predictor.predict(questions)[0] == SquadPredictor(exported).predict(questions)[0]


def test_wrong_models_are_one_line_errors(squad_run, tmp_path: Path) -> None:
    encoder = tmp_path / "encoder.onnx"
    assert cli.main(["export", "--checkpoint", str(squad_run[0]), "--task", "encoder",
                     "--output", str(encoder)]) == 0
    for model, fragment in [(encoder, "is not a popbert squad export"),
                            (tmp_path / "missing.onnx", "--model: file not found")]:
        result = subprocess.run([sys.executable, "-m", "popbert", "predict", "squad",
                                 "--model", str(model), "--data", str(FIXTURE), "--output",
                                 str(tmp_path / "p.json")],
                                capture_output=True, text=True, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert fragment in lines[0]
        assert not (tmp_path / "p.json").exists()
