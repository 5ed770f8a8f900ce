"""sentence-transformers CrossEncoder folders, both ways: a real CrossEncoder folder (a random
small BERT saved by `CrossEncoder.save`) imported with `popbert import-hf`, exported with `--task
classification` and served by `popbert predict rerank` / `predict classify` gives
`CrossEncoder.predict`'s scores (its activation, sigmoid, applied to the logit); `popbert
export-hf` writes a folder `CrossEncoder(path)` loads with the same activation and scores.

Tolerance: 1e-5 on each score (two float32 implementations of the same encoder and head).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from popbert.cli.main import main
from popbert.data.retrieval import read_beir

BEIR = Path(__file__).parent.parent / "fixtures" / "retrieval"


def small_cross_encoder(directory: Path, activation: torch.nn.Module | None = None,
                        init_range: float = 0.3) -> None:
    """A random two-layer BERT with one output and the bundled vocabulary, saved by
    sentence-transformers as a CrossEncoder folder (default activation: its Sigmoid)."""
    import transformers
    from sentence_transformers import CrossEncoder

    from popbert.data.tokenization import bundled_vocab_path

    torch.manual_seed(5)
    base = directory.parent / f"{directory.name}-bert"
    vocab = bundled_vocab_path()
    config = transformers.BertConfig(vocab_size=len(vocab.read_text().splitlines()),
                                     hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=128,
                                     num_labels=1, initializer_range=init_range)
    # Weights of std 0.3: logits from about -3.4 to 2.5 here (at BERT's 0.02 every score is
    # near 0.5; at 0.5 the float32 error of both implementations grows to 5e-5 on a logit).
    transformers.BertForSequenceClassification(config).save_pretrained(str(base))
    transformers.BertTokenizerFast(str(vocab), do_lower_case=True).save_pretrained(str(base))
    CrossEncoder(str(base), device="cpu", activation_fn=activation).save(str(directory))


def rerank_rows() -> list[dict]:
    """Three real queries, each with four Wikipedia leads (some longer than the 128 tokens a
    pair holds, so truncation is compared too); the second row's candidates plain texts."""
    beir = read_beir(BEIR)
    documents = sorted(beir.corpus)
    rows = [{"query": beir.queries[q], "candidates": [
        {"id": d, "text": beir.corpus[d]} for d in documents[4 * i:4 * i + 4]]}
        for i, q in enumerate(sorted(beir.queries)[:3])]
    rows[1]["candidates"] = [c["text"] for c in rows[1]["candidates"]]
    rows[2]["candidates"].append({"id": "short", "text": "A short passage."})
    return rows


def texts_of(row: dict) -> list[str]:
    return [c["text"] if isinstance(c, dict) else c for c in row["candidates"]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CrossEncoder folder, imported and exported as a classification model (root/ce,
    root/ckpt, root/scorer.onnx)."""
    root = tmp_path_factory.mktemp("cross-encoder")
    small_cross_encoder(root / "ce")
    assert main(["import-hf", "--model", str(root / "ce"), "--output-dir",
                 str(root / "ckpt")]) == 0
    assert main(["export", "--checkpoint", str(root / "ckpt"), "--task", "classification",
                 "--output", str(root / "scorer.onnx")]) == 0
    return root


@pytest.mark.e2e
def test_predict_rerank_gives_cross_encoder_predict_scores(imported: Path,
                                                           tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    assert "activation: sigmoid" in (imported / "ckpt" / "config.yaml").read_text()
    rows = rerank_rows()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "ranked.jsonl"
    assert main(["predict", "rerank", "--model", str(imported / "scorer.onnx"), "--data",
                 str(data), "-o", str(output)]) == 0
    reference = CrossEncoder(str(imported / "ce"), device="cpu")
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(written) == len(rows)
    for row, result in zip(rows, written):
        texts = texts_of(row)
        theirs = reference.predict([(row["query"], t) for t in texts])
        ours = {c["text"]: c["score"] for c in result["ranked"]}
        np.testing.assert_allclose([ours[t] for t in texts], theirs, atol=1e-5, rtol=0)
        assert [c["text"] for c in result["ranked"]] == [texts[i] for i in
                                                         np.argsort(-theirs, kind="stable")]
    every = np.concatenate([reference.predict([(r["query"], t) for t in texts_of(r)])
                            for r in rows])
    assert every.min() < 0.2 and every.max() > 0.8  # sigmoid, over a spread of logits

    # predict classify on the same pairs writes the same scores
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"sentence1": r["query"], "sentence2": t}) + "\n"
                             for r in rows for t in texts_of(r)))
    scored = tmp_path / "scored.jsonl"
    assert main(["predict", "classify", "--model", str(imported / "scorer.onnx"), "--data",
                 str(pairs), "-o", str(scored)]) == 0
    np.testing.assert_allclose([json.loads(line)["score"] for line in
                                scored.read_text().splitlines()], every, atol=1e-5, rtol=0)


@pytest.mark.e2e
def test_export_hf_writes_a_cross_encoder_back(imported: Path, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(imported / "ckpt"), "--output-dir",
                 str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["sentence_transformers"]["activation_fn"] == (
        "torch.nn.modules.activation.Sigmoid")
    back, original = (CrossEncoder(str(path), device="cpu") for path in (out, imported / "ce"))
    assert isinstance(back.activation_fn, torch.nn.Sigmoid)
    pairs = [(r["query"], t) for r in rerank_rows() for t in texts_of(r)]
    np.testing.assert_allclose(back.predict(pairs), original.predict(pairs), atol=1e-5, rtol=0)
    # and in again: the activation it wrote is read back
    assert main(["import-hf", "--model", str(out), "--output-dir", str(tmp_path / "again")]) == 0
    assert "activation: sigmoid" in (tmp_path / "again" / "config.yaml").read_text()


@pytest.mark.e2e
def test_an_identity_cross_encoder_scores_raw_logits(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    small_cross_encoder(tmp_path / "ce", torch.nn.Identity(), init_range=0.2)
    assert main(["import-hf", "--model", str(tmp_path / "ce"), "--output-dir",
                 str(tmp_path / "ckpt")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--task", "classification",
                 "--output", str(tmp_path / "scorer.onnx")]) == 0
    row = rerank_rows()[0]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    assert main(["predict", "rerank", "--model", str(tmp_path / "scorer.onnx"), "--data",
                 str(data), "-o", str(tmp_path / "ranked.jsonl")]) == 0
    ours = {c["text"]: c["score"] for c in json.loads(
        (tmp_path / "ranked.jsonl").read_text())["ranked"]}
    theirs = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(
        [(row["query"], t) for t in texts_of(row)])
    assert np.abs(theirs).max() > 1.0  # logits, not probabilities
    np.testing.assert_allclose([ours[t] for t in texts_of(row)], theirs, atol=1e-5, rtol=0)


def test_every_format_of_the_activation_is_read(tmp_path: Path) -> None:
    """sentence-transformers 5+ (config_sentence_transformers.json), 4.x (config.json's
    `sentence_transformers`) and older (`sbert_ce_default_activation_function`) folders; a plain
    Hugging Face directory is no CrossEncoder."""
    from popbert.hf.checkpoint import cross_encoder_activation, read_cross_encoder

    small_cross_encoder(tmp_path / "ce")
    cross = read_cross_encoder(tmp_path / "ce")
    assert cross is not None and cross.model_dir == tmp_path / "ce"
    assert cross_encoder_activation(cross) == "sigmoid" and cross.max_seq_length == 128
    plain = tmp_path / "ce-bert"  # what CrossEncoder loaded: transformers' folder
    assert read_cross_encoder(plain) is None
    config = json.loads((plain / "config.json").read_text())
    for key, value, expected in (
            ("sentence_transformers", {"activation_fn": "torch.nn.modules.linear.Identity",
                                       "version": "4.1.0"}, "identity"),
            ("sentence_transformers", {"version": "4.1.0"}, None),  # its default
            ("sbert_ce_default_activation_function", "torch.nn.modules.activation.Sigmoid",
             "sigmoid")):
        (plain / "config.json").write_text(json.dumps({**config, key: value}))
        cross = read_cross_encoder(plain)
        assert cross is not None and cross_encoder_activation(cross) == expected, key


def test_task_metadata_carries_the_activation_only_when_recorded() -> None:
    from popbert.builders.bert_config import BertConfig, TaskConfig
    from popbert.tasks import task_metadata

    regression = BertConfig(task=TaskConfig(name="classification", num_labels=1))
    assert "activation" not in task_metadata(regression)  # popbert's own: raw scores
    regression.task.activation = "sigmoid"
    assert task_metadata(regression)["activation"] == "sigmoid"


@pytest.mark.parametrize(("where", "value"), [
    ("modules", "torch.nn.modules.activation.Tanh"),
    ("config.json", "my_package.activations.Scaled")])
def test_an_activation_popbert_does_not_apply_is_one_line(where: str, value: str,
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    folder = tmp_path / "ce"
    if where == "modules":
        small_cross_encoder(folder, torch.nn.Tanh())
        named = folder / "config_sentence_transformers.json"
    else:
        small_cross_encoder(tmp_path / "new")
        folder = tmp_path / "new-bert"  # a sentence-transformers 4 folder: config.json only
        named = folder / "config.json"
        config = json.loads(named.read_text())
        named.write_text(json.dumps({**config, "sentence_transformers": {"activation_fn": value}}))
    capsys.readouterr()
    assert main(["import-hf", "--model", str(folder), "--output-dir",
                 str(tmp_path / "ckpt")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and str(named) in errors[0] and value in errors[0], errors
    assert not (tmp_path / "ckpt").exists()
