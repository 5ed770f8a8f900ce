"""The main job end to end: `popbert pretrain` trains, checkpoints, resumes exactly, exports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import safetensors.numpy
from checkpoint_helpers import kill_after_checkpoint

import popbert
from popbert.cli.main import main
from popbert.export.inference import sample_batch
from popbert.runtime.session import InferenceSession

# A smaller tiny: one short run of a few dozen steps, fast on 2 CPU cores.
SMALL = [
    "--set",
    "model.num_layers=1",
    "--set",
    "model.hidden_size=64",
    "--set",
    "model.intermediate_size=128",
    "--set",
    "model.sequence_length=64",
    "--set",
    "model.max_position_embeddings=64",
    "--set",
    "model.max_predictions_per_seq=10",
    "--set",
    "execution.micro_batch_size=16",
    "--set",
    "optimizer.lr=0.003",
    "--set",
    "optimizer.warmup_steps=5",
    "--set",
    "training.log_every=5",
]


def pretrain(output: Path, *extra: str) -> int:
    return main(["pretrain", *SMALL, "--output-dir", str(output), *extra])


def weights(directory: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(directory / "weights.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("run") / "out"
    assert pretrain(output, "--set", "training.steps=60") == 0
    return output


@pytest.mark.e2e
def test_run_leaves_every_artifact_and_the_loss_falls(trained: Path) -> None:
    for name in (
        "config.yaml",
        "model.onnx",
        "model.inference.onnx",
        "metrics.jsonl",
        "metrics.png",
    ):
        assert (trained / name).is_file(), name
    assert (trained / "checkpoints" / "step-000060" / "weights.safetensors").is_file()
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5, 61, 5))
    first, last = records[0]["mlm_loss"], records[-1]["mlm_loss"]
    assert last < first - 1.0, (first, last)
    assert 0.0 <= records[-1]["mlm_accuracy"] <= 1.0
    assert (trained / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.e2e
def test_kill_and_resume_gives_bit_identical_weights(tmp_path: Path) -> None:
    """N steps straight == killed mid-run (SIGKILL) + `--resume` to N, bit for bit: the
    weights, and the checkpoint's files byte for byte (all but the wall time in state.json),
    so checkpoints can be deduplicated and verified by hash."""
    steps = [
        "--set",
        "training.steps=16",
        "--set",
        "training.checkpoint_every=4",
        "--set",
        "model.hidden_dropout=0.1",
        "--set",
        "model.attention_dropout=0.1",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert pretrain(straight, *steps) == 0

    kill_after_checkpoint(["pretrain", *SMALL, *steps, "--output-dir", str(killed)], killed, 4)
    assert main(["pretrain", "--resume", str(killed), "--output-dir", str(killed)]) == 0

    a = weights(straight / "checkpoints" / "step-000016")
    b = weights(killed / "checkpoints" / "step-000016")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    ours, theirs = (run / "checkpoints" / "step-000016" for run in (straight, killed))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in ("weights.safetensors", "optimizer.pt", "rng.pt", "config.yaml", "model.onnx"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    state = [json.loads((d / "state.json").read_text()) for d in (ours, theirs)]
    for record in state:
        del record["trainer"]["elapsed_s"]
    assert state[0] == state[1]


@pytest.mark.e2e
@pytest.mark.parametrize("task", ["pretraining", "encoder"])
def test_export_matches_the_torch_backend_in_onnx_runtime(
    trained: Path, tmp_path: Path, task: str
) -> None:
    output = tmp_path / f"{task}.onnx"
    assert (
        main(["export", "--checkpoint", str(trained), "--task", task, "--output", str(output)]) == 0
    )
    import onnx

    model = onnx.load(str(output))
    onnx.checker.check_model(model, full_check=True)
    assert not [a for n in model.graph.node for a in n.attribute if a.name.startswith("__")]
    config = popbert.load_config(trained / "config.yaml").model
    batch = sample_batch(config, task, batch_size=3, seed=7)
    ours = InferenceSession(model).run(batch)
    theirs = ort.InferenceSession(str(output)).run(None, batch)
    names = [o.name for o in model.graph.output]
    # Same graph, same weights; ORT's fused kernels reorder FP32 sums (see export.VERIFY_ATOL).
    for name, value in zip(names, theirs):
        np.testing.assert_allclose(ours[name].numpy(), value, atol=1e-4, rtol=0, err_msg=name)
    trained_weights = weights(trained / "checkpoints" / "step-000060")
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(
        exported["Embedding/Embedding_Dict"], trained_weights["Embedding/Embedding_Dict"]
    )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "popbert", *args], capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("popbert: error:"), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_vocabulary_size_mismatch_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_cli(
        "pretrain", "--set", "model.vocab_size=1000", "--output-dir", str(tmp_path / "out")
    )
    assert_one_line_error(result, "model.vocab_size", "1000", "8192")
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_corrupt_checkpoint_is_a_one_line_error(trained: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(trained / "checkpoints" / "step-000060", broken)
    (broken / "weights.safetensors").write_bytes(b"not a safetensors file")
    result = run_cli(
        "pretrain",
        "--resume",
        str(broken),
        "--set",
        "training.steps=70",
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert_one_line_error(result, "weights.safetensors")
    result = run_cli(
        "export",
        "--checkpoint",
        str(tmp_path / "nowhere"),
        "--task",
        "encoder",
        "--output",
        str(tmp_path / "x.onnx"),
    )
    assert_one_line_error(result, "nowhere")
    assert not (tmp_path / "x.onnx").exists()
