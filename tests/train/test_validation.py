"""Validation during pre-training: a held-out split by document, `val_*` metrics at the
`training.eval_every` steps, training unchanged by evaluating, the plot's validation curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from popbert.builders.bert import build_bert
from popbert.cli.main import main
from popbert.config import load_config
from popbert.data.corpus import read_documents, read_text_documents
from popbert.data.loader import load_or_create_instances, split_documents
from popbert.data.tokenization import WordPieceTokenizer, bundled_corpus_path, bundled_vocab_path
from popbert.errors import ConfigError
from popbert.observe.plots import draw_metrics
from popbert.observe.tracking import read_metrics
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

SMALL = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
         "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
         "--set", "model.sequence_length=32", "--set", "model.max_position_embeddings=32",
         "--set", "model.max_predictions_per_seq=5", "--set", "execution.micro_batch_size=8",
         "--set", "training.log_every=2", "--set", "optimizer.warmup_steps=2"]
HELD_OUT = ["--set", "data.validation_fraction=0.02", "--set", "training.eval_batches=2"]
VAL_KEYS = {"val_loss", "val_mlm_loss", "val_mlm_accuracy", "val_nsp_accuracy"}


def pretrain(*args: str) -> int:
    return main(["pretrain", *SMALL, *args])


def val_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]


def final_weights(run: Path, step: int) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(
        str(run / "checkpoints" / f"step-{step:06d}" / "weights.safetensors"))


def unmasked_rows(arrays: dict[str, np.ndarray]) -> str:
    """Every instance's tokens with the masked positions restored, as one searchable string."""
    ids = arrays["input_ids"].copy()
    for row, (positions, labels) in enumerate(zip(arrays["masked_lm_positions"],
                                                  arrays["masked_lm_ids"])):
        real = labels != 0
        ids[row, positions[real]] = labels[real]
    return "|".join(" " + " ".join(map(str, r)) + " " for r in ids.tolist())


def test_held_out_documents_are_never_trained_on() -> None:
    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    documents = read_documents(bundled_corpus_path(), tokenizer)
    train_docs, held = split_documents(documents, 0.02, 12345)
    assert len(held) == round(0.02 * len(documents)) and len(train_docs) + len(held) == len(
        documents)
    assert split_documents(documents, 0.02, 12345)[1] == held  # deterministic by the seed
    assert split_documents(documents, 0.02, 1)[1] != held
    kwargs = {"sequence_length": 32, "max_predictions_per_seq": 5, "seed": 12345,
              "validation_fraction": 0.02}
    train = unmasked_rows(load_or_create_instances(None, None, **kwargs))
    val = unmasked_rows(load_or_create_instances(None, None, **kwargs, split="validation"))
    trained = {tuple(s) for d in train_docs for s in d}
    sentences = [" " + " ".join(map(str, s)) + " " for d in held for s in d
                 if 8 <= len(s) <= 20 and tuple(s) not in trained]
    assert len(sentences) > 20
    assert not [s for s in sentences if s in train]
    assert sum(s in val for s in sentences) > len(sentences) // 4  # they are validated on


@pytest.mark.e2e
def test_val_metrics_at_eval_steps_and_after_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*HELD_OUT, "--set", "training.eval_every=3", "--set", "training.steps=7",
            "--set", "training.checkpoint_every=2", "--set", "training.keep_checkpoints=0"]
    assert pretrain("--output-dir", str(run), *args) == 0
    whole = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in whole] == [2, 3, 4, 6, 7]  # step 3: logged for evaluating
    assert val_steps(run) == [3, 6]
    for r in whole:
        assert VAL_KEYS <= set(r) if r["step"] in (3, 6) else not VAL_KEYS & set(r)
        if r["step"] in (3, 6):
            assert all(np.isfinite(r[k]) for k in VAL_KEYS)
            assert 0.0 <= r["val_mlm_accuracy"] <= 1.0
    # Resumed from step 2: the same evaluations at the same steps, with the same values.
    assert pretrain("--resume", str(run / "checkpoints" / "step-000002"), *args) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r.get("val_loss")) for r in records] == [
        (r["step"], r.get("val_loss")) for r in whole]
    # The plot has the validation curves next to the training ones.
    assert (run / "metrics.png").stat().st_size > 0
    fig = draw_metrics(read_metrics(run / "metrics.jsonl"), "t")
    loss_ax, accuracy_ax = fig.axes[0], fig.axes[1]
    curves = {line.get_label(): list(line.get_xdata()) for line in loss_ax.get_lines()}
    assert curves["validation total"] == [3, 6] and curves["total"] == [2, 3, 4, 6, 7]
    assert "validation masked LM" in {line.get_label() for line in accuracy_ax.get_lines()}


@pytest.mark.e2e
def test_evaluating_does_not_change_training(tmp_path: Path) -> None:
    steps = ["--set", "training.steps=6"]
    assert pretrain("--output-dir", str(tmp_path / "plain"), *HELD_OUT, *steps) == 0
    assert pretrain("--output-dir", str(tmp_path / "eval"), *HELD_OUT, *steps,
                    "--set", "training.eval_every=2") == 0
    assert val_steps(tmp_path / "eval") == [2, 4, 6] and val_steps(tmp_path / "plain") == []
    plain, evaluated = final_weights(tmp_path / "plain", 6), final_weights(tmp_path / "eval", 6)
    assert plain.keys() == evaluated.keys()
    for name in plain:
        np.testing.assert_array_equal(plain[name], evaluated[name], err_msg=name)


@pytest.mark.e2e
def test_validation_files_text(tmp_path: Path) -> None:
    documents = read_text_documents(bundled_corpus_path())[:40]
    held = tmp_path / "held.txt"
    held.write_text("\n\n".join("\n".join(d) for d in documents) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    assert pretrain("--output-dir", str(run), "--set", f"data.validation_files=[{held}]",
                    "--set", "training.eval_every=2", "--set", "training.steps=2") == 0
    record = read_metrics(run / "metrics.jsonl")[-1]
    assert VAL_KEYS <= set(record) and record["step"] == 2


@pytest.mark.e2e
def test_validation_files_hdf5_shard(tmp_path: Path) -> None:
    from popbert.data.hdf5 import write_shard

    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    arrays = load_or_create_instances(None, None, 32, 5, seed=3)
    shard = write_shard(tmp_path / "held.h5", {k: v[:40] for k, v in arrays.items()},
                        vocab_size=tokenizer.vocab_size, vocab_sha256=tokenizer.vocab_sha256)
    run = tmp_path / "run"
    assert pretrain("--output-dir", str(run), "--set", f"data.validation_files=[{shard}]",
                    "--set", "training.eval_every=1", "--set", "training.eval_batches=6",
                    "--set", "training.steps=2") == 0  # 6 x 8 > 40 samples: they wrap
    assert val_steps(run) == [1, 2]


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.validation_fraction=-0.1"], "data.validation_fraction must be in [0, 1)"),
    (["data.validation_fraction=1.0"], "data.validation_fraction must be in [0, 1)"),
    (["training.eval_every=10"], "training.eval_every is 10 but there is no validation data"),
    (["data.input_files=[a.h5]", "data.validation_fraction=0.02"],
     "data.input_files are HDF5 shards"),
    (["data.validation_fraction=0.02", "data.validation_files=[v.txt]"], "both given"),
    (["training.eval_every=-1"], "training.eval_every must be >= 0"),
    (["training.eval_share=0.5"], "training.eval_share sizes evaluations to "
                                  "training.time_budget; set a budget"),
    (["training.time_budget=60", "training.eval_share=0"], "training.eval_share must be > 0"),
    (["training.time_budget=60", "training.eval_share=0.5"],
     "training.eval_share sizes the evaluations of training.eval_points or training.eval_every "
     "on validation data"),
    (["training.time_budget=60", "training.eval_share=0.5", "training.eval_points=4"],
     "this run has none to size: remove it"),
])
def test_config_errors_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config("tiny", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("layout", ["plain", "pipeline", "half"])
def test_session_evaluate(layout: str) -> None:
    """Dropout off, no gradients, train mode and the RNG restored, on every forward path."""
    cfg = load_config("tiny", ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
                               "model.intermediate_size=64", "model.sequence_length=32",
                               "model.max_position_embeddings=32",
                               "model.max_predictions_per_seq=5", "model.layers_per_ipu=[1,1]"])
    graph = build_bert(cfg.model, seed=0)
    options = {"plain": SessionOptions(device="cpu"),
               "pipeline": SessionOptions(device="cpu", pipeline=True, gradient_accumulation=2),
               "half": SessionOptions(device="cpu", weight_dtype="float16")}[layout]
    session = TrainingSession(graph.model(), graph.loss,
                              lambda named: torch.optim.SGD([w for _, w in named], lr=0.1),
                              options)
    arrays = load_or_create_instances(None, None, 32, 5, seed=0)
    batch = {k: torch.from_numpy(v[:4]).long() for k, v in arrays.items()}
    rng = torch.get_rng_state()
    first, second = session.evaluate(batch), session.evaluate(batch)
    assert torch.equal(torch.get_rng_state(), rng)
    assert session.module.training
    assert torch.equal(first["loss"], second["loss"]) and torch.isfinite(first["loss"])
    assert not first["loss"].requires_grad
    assert all(p.grad is None for _, p in session.named_parameters)
    if layout != "plain":
        plain = TrainingSession(graph.model(), graph.loss,
                                lambda named: torch.optim.SGD([w for _, w in named], lr=0.1),
                                SessionOptions(device="cpu"))
        plain.load_weights({n: w.float() for n, w in session.weights().items()})
        torch.testing.assert_close(plain.evaluate(batch)["loss"], first["loss"],
                                   atol=1e-3 if layout == "half" else 1e-5, rtol=0)
    assert json.dumps({k: float(v) for k, v in first.items() if v.dim() == 0})


def test_popart_backend_accepts_eval_every(monkeypatch: pytest.MonkeyPatch) -> None:
    """PopartTrainingSession evaluates on an inference session of its own, so validation
    during pre-training is accepted on the popart backend too."""
    import importlib
    import sys

    from popbert.train.pretrain import check_supported

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "popart_standin"))
    monkeypatch.delitem(sys.modules, "popart", raising=False)
    assert importlib.import_module("popart").__standin__
    try:
        cfg = load_config("tiny", ["execution.backend=popart", "model.dialect=popart",
                                   "data.validation_fraction=0.02", "training.eval_every=5"])
        check_supported(cfg)
    finally:
        sys.modules.pop("popart", None)


REPLICATED = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "execution.device=cpu",
              "execution.threads=1", "training.steps=4", "training.log_every=2",
              "training.eval_every=2", "data.validation_fraction=0.02"]


def replicated_config(replicas: int, eval_batches: int):
    small = [arg for arg in SMALL if arg != "--set"]
    return load_config("tiny", [*small, *REPLICATED, f"execution.replicas={replicas}",
                                f"execution.gradient_accumulation={2 // replicas}",
                                f"training.eval_batches={eval_batches}"])


def _replica(rank: int, init_method: str, out: str) -> None:
    """One of two replicas (spawned: importable, no pytest state)."""
    import torch.distributed as dist
    from trainer_helpers import run_pretraining

    from popbert.distributed import Replicas

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    run_pretraining(replicated_config(2, 2), Path(out),
                    replicas=Replicas.from_group(None, owns_process_group=True))


@pytest.mark.e2e
def test_replicas_evaluate_their_shares_and_average(tmp_path: Path) -> None:
    """Two replicas × 2 validation batches each = one replica × the same 4 batches."""
    import torch.multiprocessing as mp
    from replica_helpers import rendezvous
    from trainer_helpers import run_pretraining

    run_pretraining(replicated_config(1, 4), tmp_path / "one")
    mp.spawn(_replica, args=(rendezvous(tmp_path), str(tmp_path / "two")), nprocs=2, join=True)
    one = {r["step"]: r for r in read_metrics(tmp_path / "one" / "metrics.jsonl")}
    two = {r["step"]: r for r in read_metrics(tmp_path / "two" / "metrics.jsonl")}
    assert val_steps(tmp_path / "one") == val_steps(tmp_path / "two") == [2, 4]
    for step in (2, 4):
        for key in VAL_KEYS:
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-4), (step, key)
