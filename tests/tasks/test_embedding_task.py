"""Embedding training through the task seam: the graph's losses are sentence-transformers'
(MultipleNegativesRankingLoss with hard negatives, its symmetric form, CoSENTLoss,
MatryoshkaLoss) on a SentenceTransformer holding the same weights, loss and gradients.

Tolerances: loss at 1e-5 and every gradient at 1e-4 of its largest entry, + 1e-7 (the float32
forward and backward of two implementations of one computation, summed in different orders).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import small_config

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.cli.main import main
from popbert.hf import mapping as hf
from popbert.runtime.session import TrainingSession

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(295)]


def sentence_transformer(config, weights: dict[str, np.ndarray], folder: Path, pooling: str):
    """A SentenceTransformer (Transformer + Pooling) holding popbert's `weights`."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    family = config.architecture
    architecture = "BertModel" if family == "bert" else "ModernBertModel"
    state = hf.to_hf_architecture(weights, config, architecture)
    hf_config = hf.HF_FAMILIES[family].config_to_hf(config, architecture,
                                                    {t: i for i, t in enumerate(VOCAB)})
    config_class = getattr(transformers, "BertConfig" if family == "bert" else "ModernBertConfig")
    their_config = config_class(**{k: v for k, v in hf_config.items() if k != "architectures"})
    their_config._attn_implementation = "eager"
    model = getattr(transformers, architecture)(their_config)
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    model.save_pretrained(str(folder))
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=False
                                   ).save_pretrained(str(folder))
    transformer = models.Transformer(str(folder), model_kwargs={"attn_implementation": "eager"})
    return SentenceTransformer(modules=[transformer, models.Pooling(config.hidden_size, pooling)],
                               device="cpu")


def rows_batch(texts: int, rows: int = 5, length: int = 24, seed: int = 0
               ) -> dict[str, np.ndarray]:
    """Rows of `texts` random texts of varying length, [rows, texts, length]."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, texts, length), np.int64)
    mask = np.zeros_like(ids)
    for r in range(rows):
        for t in range(texts):
            n = int(rng.integers(4, length + 1))
            ids[r, t, :n] = [2, *rng.integers(5, len(VOCAB), n - 2), 3]
            mask[r, t, :n] = 1
    return {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}


CASES = {
    "mnrl-hard-negatives": dict(texts=3, loss="mnrl"),
    "mnrl-symmetric": dict(texts=2, loss="mnrl", symmetric=True),
    "mnrl-matryoshka": dict(texts=3, loss="mnrl", matryoshka_dims=[64, 32, 8]),
    "cosent": dict(texts=2, loss="cosent"),
    "cosent-matryoshka-scale": dict(texts=2, loss="cosent", scale=7.0, matryoshka_dims=[64, 16]),
}


def their_loss(model, case: dict):
    from sentence_transformers.sentence_transformer import losses

    scale = case.get("scale", 20.0)
    if case["loss"] == "cosent":
        base = losses.CoSENTLoss(model, scale=scale)
    elif case.get("symmetric"):  # the deprecated class's own recommended equivalent
        base = losses.MultipleNegativesRankingLoss(
            model, scale=scale, directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction")
    else:
        base = losses.MultipleNegativesRankingLoss(model, scale=scale)
    dims = case.get("matryoshka_dims")
    return losses.MatryoshkaLoss(model, base, dims) if dims else base


@pytest.mark.parametrize("family,case", [("bert", name) for name in CASES]
                         + [("modernbert", "mnrl-hard-negatives")])
def test_losses_and_gradients_are_sentence_transformers(family: str, case: str,
                                                        tmp_path: Path) -> None:
    settings = CASES[case]
    torch.manual_seed(0)
    extra = {} if family == "bert" else {"architecture": "modernbert",
                                         "next_sentence_prediction": False}
    head = TaskConfig(name="embedding", pooling="mean", scale=settings.get("scale", 20.0),
                      texts=settings["texts"], loss=settings["loss"],
                      symmetric=settings.get("symmetric", False),
                      matryoshka_dims=settings.get("matryoshka_dims"))
    config = small_config(task=head, vocab_size=len(VOCAB), **extra)
    model = build_bert(config, task="embedding", seed=5, dynamic_sequence=True).model()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    reference = sentence_transformer(config, weights, tmp_path / "st", "mean")
    reference.train()  # dropout is 0 in small_config: deterministic either way

    batch = rows_batch(settings["texts"])
    scores = np.array([0.1, 2.0, 3.5, 3.5, 5.0], np.float32)  # a tie, as STS-B has
    if settings["loss"] == "cosent":
        batch["labels"] = scores
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0))
    ours = session.forward(batch)
    ours["loss"].backward()

    features = []
    for text in range(settings["texts"]):
        feature = {"input_ids": torch.from_numpy(batch["input_ids"][:, text]),
                   "attention_mask": torch.from_numpy(batch["input_mask"][:, text])}
        if family == "bert":
            feature["token_type_ids"] = torch.from_numpy(batch["segment_ids"][:, text])
        features.append(feature)
    loss = their_loss(reference, settings)(features, torch.from_numpy(scores))
    loss.backward()
    torch.testing.assert_close(ours["loss"].detach(), loss.detach(), atol=1e-5, rtol=0)

    architecture = "BertModel" if family == "bert" else "ModernBertModel"
    # BertModel's pooler is in the graph but no embedding reads it: no gradient, as in theirs
    grads = hf.to_hf_architecture({n: (p.grad if p.grad is not None else torch.zeros_like(p))
                                   .numpy() for n, p in session.named_parameters},
                                  config, architecture)
    theirs = {name.split(".", 1)[1]: p.grad
              for name, p in reference[0].named_parameters() if p.grad is not None}
    assert theirs, "sentence-transformers computed no gradient"
    for name, expected in theirs.items():
        expected = expected.numpy()
        assert name in grads, name
        # + 1e-7: a key bias's gradient is zero but for rounding (softmax ignores a shift)
        assert np.abs(grads[name] - expected).max() <= 1e-4 * np.abs(expected).max() + 1e-7, \
            name


def test_trimmed_rows_give_the_padded_loss() -> None:
    """Rows of several texts cut to their longest text (`execution.trim_padding`) give the
    loss of the padded rows."""
    from popbert.runtime.inputs import PaddingTrimmer

    head = TaskConfig(name="embedding", pooling="mean", scale=20.0, texts=3, loss="mnrl",
                      symmetric=False)
    config = small_config(task=head, vocab_size=len(VOCAB))
    model = build_bert(config, task="embedding", seed=2, dynamic_sequence=True).model()
    batch = rows_batch(3, length=32)
    batch["input_ids"][..., 20:] = 0
    batch["input_mask"][..., 20:] = 0
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0))
    padded = session.forward(batch)["loss"]
    trimmer = PaddingTrimmer(session.inputs.specs)
    trimmed = trimmer({k: torch.from_numpy(v) for k, v in batch.items()})
    assert trimmed["input_ids"].shape == (5, 3, 24)  # 20 real columns, rounded up to 8
    torch.testing.assert_close(session.forward(trimmed)["loss"], padded, atol=1e-5, rtol=0)


FIXTURES = Path(__file__).parent.parent / "fixtures"
TRIPLETS = FIXTURES / "embedding" / "triplets.jsonl"  # 30 inverse-cloze rows (README)
BEIR = FIXTURES / "retrieval"


@pytest.mark.e2e
def test_finetune_export_predict_and_sentence_transformers(
        pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fine-tune on (anchor, positive, negative) rows scored on a BEIR directory; the ONNX
    export scores the same, and export-hf gives a folder sentence-transformers loads with the
    export's vectors (1e-5)."""
    from sentence_transformers import SentenceTransformer

    run = tmp_path / "embed"
    capsys.readouterr()
    assert main(["finetune", "embedding", "--checkpoint", str(pretrained), "--train",
                 str(TRIPLETS), "--eval", str(BEIR), "--epochs", "2", "--batch-size", "8",
                 "--max-seq-length", "64", "--symmetric", "--device", "cpu",
                 "--set", "execution.trim_padding=true", "-o", str(run)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((run / "eval_results.json").read_text())
    assert printed["ndcg@10"] == results["ndcg@10"] and results["queries"] == 30
    task = __import__("yaml").safe_load((run / "config.yaml").read_text())["model"]["task"]
    assert (task["name"], task["texts"], task["loss"], task["symmetric"]) == \
        ("embedding", 3, "mnrl", True)

    model = tmp_path / "embed.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "embedding", "--output",
                 str(model)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "retrieval", "--model", str(model), "--beir", str(BEIR)]) == 0
    exported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert exported["ndcg@10"] == pytest.approx(results["ndcg@10"], abs=1e-6)

    texts = tmp_path / "texts.txt"
    texts.write_text("The whale shark is a fish.\nPyongyang is a city.\n")
    vectors = tmp_path / "vectors.npy"
    assert main(["predict", "embed", "--model", str(model), "--data", str(texts), "-o",
                 str(vectors)]) == 0
    folder = tmp_path / "st"
    assert main(["export-hf", "--checkpoint", str(run), "--output-dir", str(folder)]) == 0
    theirs = SentenceTransformer(str(folder), device="cpu").encode(
        texts.read_text().splitlines())
    np.testing.assert_allclose(np.load(vectors), theirs, atol=1e-5, rtol=0)


@pytest.mark.e2e
def test_scored_pairs_train_cosent_with_matryoshka(pretrained: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A file with a score column trains CoSENT (the default there) and is scored by Spearman's
    correlation of cosine and score; Parquet reads as JSON lines does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [line.split("\t") for line in
            (FIXTURES / "classification" / "relatedness.tsv").read_text().splitlines()[1:]]
    table = pa.table({"sentence1": [r[0] for r in rows], "sentence2": [r[1] for r in rows],
                      "score": [float(r[2]) for r in rows]})
    data = tmp_path / "pairs.parquet"
    pq.write_table(table, data)
    run = tmp_path / "cosent"
    capsys.readouterr()
    assert main(["finetune", "embedding", "--checkpoint", str(pretrained), "--train",
                 str(data), "--matryoshka-dims", "64,16", "--epochs", "1", "--device", "cpu",
                 "-o", str(run)]) == 0
    results = json.loads((run / "eval_results.json").read_text())
    assert set(results) == {"pearson", "spearman", "examples"} and results["examples"] == 60
    task = __import__("yaml").safe_load((run / "config.yaml").read_text())["model"]["task"]
    assert (task["loss"], task["texts"], task["matryoshka_dims"]) == ("cosent", 2, [64, 16])


BAD_PAIRS = {
    "empty-positive": ('{"anchor": "a b", "positive": ""}\n', ".jsonl",
                       "column 'positive' is empty"),
    "missing-negative": ('{"anchor": "a", "positive": "b", "negative": "c"}\n'
                         '{"anchor": "a", "positive": "b"}\n', ".jsonl",
                         ":2: column 'negative' is missing"),
    "score-not-a-number": ("sentence1,sentence2,score\na,b,high\n", ".csv",
                           "column 'score' is 'high'"),
    "negatives-differ": ('{"anchor": "a", "positive": "b", "negative": ["c", "d"]}\n'
                         '{"anchor": "a", "positive": "b", "negative": ["c"]}\n', ".jsonl",
                         "1 negatives, line 1 has 2"),
    "no-anchor": ('{"query": "a", "positive": "b"}\n', ".jsonl", "without an anchor column"),
}


@pytest.mark.parametrize("case", BAD_PAIRS)
def test_bad_pairs_are_one_line_and_write_nothing(case: str, pretrained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    text, suffix, expected = BAD_PAIRS[case]
    data = tmp_path / f"pairs{suffix}"
    data.write_text(text)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["finetune", "embedding", "--checkpoint", str(pretrained), "--train",
                 str(data), "--device", "cpu", "-o", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("popbert: error:")]
    assert len(errors) == 1 and expected in errors[0], errors
    assert not run.exists()


@pytest.mark.e2e
def test_torchrun_two_replicas_train_as_one_process_of_the_global_batch(
        pretrained: Path, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m popbert finetune embedding --batch-size 4` (negatives
    from both replicas) ends with the weights of one process at --batch-size 8 on the same
    rows (24 rows: 3 global batches; no dropout). Relative 1e-5 over all weights. Adam's eps is
    1e-3 so each step is linear in its gradient: at 1e-6 an element whose gradient cancels to
    about zero (its sum's order differs between 2 replicas and 1) takes a step of any size."""
    import os
    import subprocess
    import sys

    from replica_helpers import assert_same, free_port

    from popbert.io.checkpoint import load_checkpoint

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(TRIPLETS.read_text().splitlines(keepends=True)[:24]))
    common = ["finetune", "embedding", "--checkpoint", str(pretrained), "--train", str(data),
              "--epochs", "1", "--dropout", "0", "--device", "cpu", "--lr", "1e-3",
              "--max-seq-length", "48", "--symmetric", "--set", "optimizer.eps=1e-3"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "popbert", *common,
         "--batch-size", "4", "--set", "execution.replicas=2", "-o", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main([*common, "--batch-size", "8", "--threads", "1", "-o",
                 str(tmp_path / "one")]) == 0

    def weights(run: Path) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in load_checkpoint(run, weights_only=True)
                .weights.items()}

    two, one = weights(tmp_path / "two"), weights(tmp_path / "one")
    assert_same(two, one, 1e-5, "2 replicas x 4 against 1 x 8")
    assert json.loads((tmp_path / "two" / "eval_results.json").read_text())["queries"] == 24


@pytest.mark.parametrize("settings", [dict(texts=3, loss="mnrl", symmetric=True),
                                      dict(texts=2, loss="cosent",
                                           matryoshka_dims=[64, 16])],
                         ids=["mnrl", "cosent-matryoshka"])
@pytest.mark.parametrize("mode", ["trimmed", "cached", "cached-trimmed"])
def test_text_by_text_and_cached_gradients_equal_one_padded_pass(settings: dict, mode: str,
                                                                monkeypatch) -> None:
    """Every text of the micro-batch trimmed in groups of similar length
    (`execution.trim_padding`: anchors of at most 8 tokens, positives of up to 24; a group per
    width here), and gradient caching (`execution.gradient_cache_rows`, 2 rows a pass over 6,
    each slot trimmed), give the loss and the gradients of one padded pass over the 6 rows
    (1e-5; 1e-4 of each largest gradient)."""
    import popbert.runtime.groups
    from popbert.runtime.options import SessionOptions

    monkeypatch.setattr(popbert.runtime.groups, "CALL_COST_TOKENS", 0)

    head = TaskConfig(name="embedding", pooling="mean", scale=20.0, **settings)
    config = small_config(task=head, vocab_size=len(VOCAB))
    model = build_bert(config, task="embedding", seed=7, dynamic_sequence=True).model()
    arrays = rows_batch(settings["texts"], rows=6)
    arrays["input_mask"][:, 0, 8:] = 0  # short anchors, as first sentences are
    arrays["input_ids"][:, 0, 8:] = 0
    batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
    batch["labels"] = torch.tensor([0.0, 1.0, 5.0, 2.0, 2.0, 4.0])

    def step(options: SessionOptions) -> tuple[float, dict[str, torch.Tensor]]:
        session = TrainingSession(model, "loss", lambda p: torch.optim.SGD(
            [x for _, x in p], lr=0.0), options)
        assert (session._rows is not None) == (options != SessionOptions())
        out = session.train_step([{k: v for k, v in batch.items()
                                   if k in session.input_names}])
        return float(out["loss"]), {n: p.grad.clone() if p.grad is not None else
                                    torch.zeros_like(p) for n, p in session.named_parameters}

    loss, grads = step(SessionOptions())
    other_loss, other = step(SessionOptions(trim_padding="trimmed" in mode,
                                            gradient_cache_rows=2 if "cached" in mode
                                            else None))
    assert abs(other_loss - loss) <= 1e-5
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, grad in grads.items():
        assert (other[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name


@pytest.mark.parametrize("flag,value,key", [("--mini-batch-size", "0",
                                             "execution.gradient_cache_rows"),
                                            ("--scale", "-1", "finetune.scale"),
                                            ("--epochs", "0", "finetune.epochs")])
def test_a_flag_out_of_range_is_named_as_the_flag(flag: str, value: str, key: str,
                                                  pretrained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["finetune", "embedding", "--checkpoint", str(pretrained), "--train",
                 str(TRIPLETS), flag, value, "-o", str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("popbert: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"popbert: error: {flag} ") \
        and key in errors[0], errors
    assert not (tmp_path / "run").exists()
