"""Token classification through the task seam: the head and its loss equal transformers'
`BertForTokenClassification` / `ModernBertForTokenClassification` with the same weights, a
fine-tune on CoNLL scores what seqeval scores, and the model goes through `popbert export`,
`popbert predict ner` and Hugging Face both ways.

Tolerances: logits and loss against transformers at 1e-5 (the float32 forward of two
implementations of one graph); entity scores against seqeval at 1e-12 (the same counts);
ONNX Runtime's tags against the torch backend's exactly (argmax of logits that agree to 1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from bert_helpers import padded_batch, small_config

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import TaskConfig
from popbert.cli.main import main
from popbert.hf import mapping as hf
from popbert.runtime.session import TrainingSession

LABELS = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
TOKENS = TaskConfig(name="token-classification", num_labels=len(LABELS), labels=LABELS)
FIXTURE = Path(__file__).parent.parent / "fixtures" / "ner"


def weights_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_the_head_and_loss_are_transformers(family: str) -> None:
    import transformers

    torch.manual_seed(0)
    extra = {} if family == "bert" else {"architecture": "modernbert",
                                         "next_sentence_prediction": False}
    config = small_config(task=TOKENS, **extra)
    model = build_bert(config, task="token-classification", seed=4).model()
    architecture = hf.task_architecture(family, "token-classification")
    state = hf.to_hf_architecture(weights_of(model), config, architecture)
    hf_config = hf.HF_FAMILIES[family].config_to_hf(config, architecture,
                                                    {"[PAD]": 0, "[CLS]": 2, "[SEP]": 3,
                                                     "[MASK]": 4, "[UNK]": 1})
    hf_config["num_labels"] = len(LABELS)
    config_class = getattr(transformers, "BertConfig" if family == "bert" else "ModernBertConfig")
    their_config = config_class(**{k: v for k, v in hf_config.items() if k != "architectures"})
    their_config.num_labels = len(LABELS)
    their_config._attn_implementation = "eager"
    reference = getattr(transformers, architecture)(their_config)
    missing, unexpected = reference.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    reference.eval()

    batch = {k: v for k, v in padded_batch(config, batch_size=3, seed=2).items()
             if k in ("input_ids", "segment_ids", "input_mask")}
    if family != "bert":
        batch.pop("segment_ids")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, len(LABELS), batch["input_ids"].shape)
    labels[batch["input_mask"] == 0] = -100
    labels[:, 0] = -100
    batch["labels"] = labels
    session = TrainingSession(model, "loss", lambda p: torch.optim.SGD([x for _, x in p], lr=0))
    ours = session.forward(batch)
    kwargs = {"input_ids": torch.from_numpy(batch["input_ids"]),
              "attention_mask": torch.from_numpy(batch["input_mask"]),
              "labels": torch.from_numpy(labels)}
    if family == "bert":
        kwargs["token_type_ids"] = torch.from_numpy(batch["segment_ids"])
    with torch.no_grad():
        theirs = reference(**kwargs)
    real = torch.from_numpy(batch["input_mask"]).bool()
    torch.testing.assert_close(ours["logits"].detach()[real], theirs.logits[real], atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(ours["loss"].detach(), theirs.loss, atol=1e-5, rtol=0)



def conll_tags(path: Path) -> list[list[str]]:
    """The last column of each sentence of a CoNLL file (blank lines between sentences)."""
    sentences, current = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            if current:
                sentences.append(current)
            current = []
        elif not line.startswith("-DOCSTART-"):
            current.append(line.split()[-1])
    return sentences + ([current] if current else [])


@pytest.mark.e2e
def test_finetune_export_predict_and_hugging_face(pretrained: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import seqeval.metrics
    import transformers

    data = FIXTURE / "sample.conll"
    run = tmp_path / "ner"
    capsys.readouterr()
    assert main(["finetune", "ner", "--checkpoint", str(pretrained), "--train", str(data),
                 "--epochs", "2", "--max-seq-length", "32", "--device", "cpu", "-o",
                 str(run)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((run / "eval_results.json").read_text())
    predicted = conll_tags(run / "eval_predictions.conll")
    gold = [[t for t in sentence] for sentence in conll_tags(data)]
    assert len(predicted) == len(gold) and printed["f1"] == results["f1"]
    assert results["f1"] == pytest.approx(seqeval.metrics.f1_score(gold, predicted), abs=1e-12)
    assert results["precision"] == pytest.approx(
        seqeval.metrics.precision_score(gold, predicted), abs=1e-12)

    model = tmp_path / "ner.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "token-classification",
                 "--output", str(model)]) == 0
    tagged = tmp_path / "tagged.conll"
    assert main(["predict", "ner", "--model", str(model), "--data", str(data), "-o",
                 str(tagged)]) == 0
    assert conll_tags(tagged) == predicted  # ONNX Runtime tags as the torch backend did
    lines = [line for line in tagged.read_text().splitlines() if line.strip()]
    words = [line for line in data.read_text().splitlines()
             if line.strip() and not line.startswith("-DOCSTART-")]
    assert [line.rsplit(maxsplit=1)[0] for line in lines] == words  # input columns kept

    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(run), "--output-dir", str(out)]) == 0
    reference, info = transformers.BertForTokenClassification.from_pretrained(
        str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reference.config.id2label == dict(enumerate(json.loads(
        json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())
                   ["model"]["task"]["labels"]))))
    back = tmp_path / "back"
    assert main(["import-hf", "--model", str(out), "--output-dir", str(back)]) == 0
    report = json.loads((back / "import.json").read_text())
    assert report["architecture"] == "BertForTokenClassification"
    assert "Tokens/Classifier/W" in report["loaded"]


def test_a_tag_training_never_saw_is_one_line(pretrained: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = FIXTURE / "sample.conll"
    other = tmp_path / "eval.conll"
    other.write_text("Paris NNP B-CITY\nis VBZ O\n\n")
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["finetune", "ner", "--checkpoint", str(pretrained), "--train", str(data),
                 "--eval", str(other), "--device", "cpu", "-o", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("popbert: error:")]
    assert len(errors) == 1 and "B-CITY" in errors[0] and str(other) in errors[0], errors
    assert not run.exists()


TEXTS = ["Barack Obama visited Paris and Berlin in 2009, meeting Angela Merkel.",
         "The Amazon river flows through Brazil; Washington is far away.",
         "Nothing here"]


@pytest.mark.e2e
def test_plain_text_entities_are_the_transformers_pipelines(tmp_path: Path) -> None:
    """Plain text in, entities with character offsets out, equal to transformers'
    token-classification pipeline with aggregation_strategy="first" on the same weights (a
    random BertForTokenClassification whose head is scaled up, so that words take every tag):
    the same groups, words and offsets, scores within 1e-4."""
    import transformers

    from popbert.data.tokenization import bundled_vocab_path

    torch.manual_seed(5)
    vocab = bundled_vocab_path()
    config = transformers.BertConfig(
        vocab_size=len(vocab.read_text().splitlines()), hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)})
    model = transformers.BertForTokenClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(40)
    source = tmp_path / "hf"
    model.save_pretrained(str(source))
    (source / "vocab.txt").write_bytes(vocab.read_bytes())
    (source / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    assert main(["import-hf", "--model", str(source), "--output-dir", str(tmp_path / "ckpt"),
                 "--sequence-length", "64"]) == 0
    exported = tmp_path / "ner.onnx"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--task",
                 "token-classification", "--output", str(exported)]) == 0
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    output = tmp_path / "entities.jsonl"
    assert main(["predict", "ner", "--model", str(exported), "--data", str(texts), "-o",
                 str(output)]) == 0
    ours = [json.loads(line) for line in output.read_text().splitlines()]

    tokenizer = transformers.BertTokenizerFast(str(source / "vocab.txt"), do_lower_case=True)
    pipeline = transformers.pipeline("token-classification", model=model, tokenizer=tokenizer,
                                     aggregation_strategy="first")
    found = 0
    for row, text in zip(ours, TEXTS):
        theirs = pipeline(text)
        assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in row["entities"]] \
            == [(e["entity_group"], e["word"], e["start"], e["end"]) for e in theirs], text
        np.testing.assert_allclose([e["score"] for e in row["entities"]],
                                   [float(e["score"]) for e in theirs], atol=1e-4)
        found += len(theirs)
    assert found >= 3  # the comparison saw entities
