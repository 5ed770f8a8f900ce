"""SQuAD v1.1: windows and labels, span decoding, the official EM/F1, and fine-tuning.

The fixture is real SQuAD v1.1 training data (tests/fixtures/squad/, see its README). The
fine-tuning test starts from the real MiniLM checkpoint and must overfit the fixture's five
questions (EM 100 on its own training questions); it then exports the model and answers the
questions again with ONNX Runtime alone, end to end as a user would.
"""

from __future__ import annotations

import json
import os
import re
import string
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from popbert.cli import main as cli
from popbert.data.squad import (
    Answer,
    Question,
    WindowOptions,
    answer_token_span,
    decode_answers,
    read_squad,
    squad_features,
)
from popbert.data.squad_metric import evaluate, exact_match_score, f1_score, normalize_answer
from popbert.data.tokenization import (
    WordPieceTokenizer,
    bundled_vocab_path,
    encode_texts,
    make_tokenizer,
    parse_vocab,
)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "squad" / "squad-v1.1-sample.json"


@pytest.fixture(scope="module")
def vocab() -> dict[str, int]:
    return parse_vocab(bundled_vocab_path().read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer(vocab: dict[str, int]):
    return make_tokenizer(vocab, lowercase=True)


# ----------------------------------------------------------------------------------------------
# Reading, tokenization, windows


def test_fixture_reads_as_five_questions_over_two_contexts() -> None:
    questions, dataset = read_squad(FIXTURE)
    assert len(questions) == 5 and len(dataset["data"]) == 1
    assert len({q.context_index for q in questions}) == 2
    for q in questions:
        for answer in q.answers:
            assert q.context[answer.start:answer.start + len(answer.text)] == answer.text


def test_the_serving_tokenizer_is_popbert_datas_tokenizer(tokenizer) -> None:
    questions, _ = read_squad(FIXTURE)
    texts = [q.context for q in questions] + [q.question for q in questions] + [
        "A literal [SEP] and [CLS] stay text; Ünïcödé and 中文 too."]
    reference = WordPieceTokenizer(bundled_vocab_path())
    ours = encode_texts(tokenizer, texts)
    assert [e.ids for e in ours] == reference.encode_batch(texts)
    for text, encoding in zip(texts, ours):  # offsets cut the original text
        for (start, end), token in zip(encoding.offsets, encoding.ids):
            piece = reference.backend.id_to_token(token).removeprefix("##")
            if piece != "[UNK]":
                assert reference.backend.normalizer.normalize_str(text[start:end]).strip() == piece


def test_windows_follow_doc_stride_and_max_query_length(tokenizer, vocab) -> None:
    questions, _ = read_squad(FIXTURE)
    options = WindowOptions(max_seq_length=48, doc_stride=16, max_query_length=8)
    features = squad_features(questions, tokenizer, vocab, options, training=True)
    cls, sep, pad = vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"]
    contexts = encode_texts(tokenizer, [q.context for q in questions])
    for q_index, question in enumerate(questions):
        windows = [w for w in features.windows if w.question_index == q_index]
        query = encode_texts(tokenizer, [question.question])[0].ids[:8]
        assert len(windows) > 1  # contexts of 100+ tokens in windows of at most 37
        starts = [w.context_start for w in windows]
        assert starts[0] == 0 and all(b - a == 16 for a, b in zip(starts, starts[1:]))
        assert windows[-1].context_end == len(contexts[q_index].ids)
        scored = Counter()
        for w in windows:
            used = int(w.input_mask.sum())
            assert list(w.input_ids[:len(query) + 2]) == [cls, *query, sep]
            assert w.input_ids[used - 1] == sep and (w.input_ids[used:] == pad).all()
            size = w.context_end - w.context_start
            assert used == len(query) + 3 + size <= 48
            assert list(w.segment_ids[:used]) == [0] * (len(query) + 2) + [1] * (size + 1)
            context_ids = w.input_ids[len(query) + 2:len(query) + 2 + size]
            assert list(context_ids) == contexts[q_index].ids[w.context_start:w.context_end]
            for position, best in enumerate(w.max_context):
                if best:
                    scored[w.context_start + position - len(query) - 2] += 1
        # Every context token is scored in exactly one window.
        assert scored == Counter(range(len(contexts[q_index].ids)))


def test_labels_point_at_the_answer_or_at_cls(tokenizer, vocab) -> None:
    questions, _ = read_squad(FIXTURE)
    options = WindowOptions(max_seq_length=48, doc_stride=16, max_query_length=8)
    features = squad_features(questions, tokenizer, vocab, options, training=True)
    starts, ends = features.arrays["start_positions"], features.arrays["end_positions"]
    labelled = set()
    for w, window in enumerate(features.windows):
        question = questions[window.question_index]
        answer = question.answers[0]
        if starts[w] == 0:
            assert ends[w] == 0
            first = window.context_start
            inside = any(span is not None and span[0] <= answer.start < span[1]
                         for span in window.spans)
            last_inside = any(span is not None and span[0] < answer.start + len(answer.text)
                              <= span[1] for span in window.spans)
            assert not (inside and last_inside), (first, answer)
            continue
        # The label is the shortest token span covering the answer.
        first, last = window.spans[starts[w]], window.spans[ends[w]]
        assert first[0] <= answer.start < first[1]
        assert last[0] < answer.start + len(answer.text) <= last[1]
        labelled.add(window.question_index)
    assert labelled == set(range(5))  # each answer (<= 9 tokens) fits some 37-token window


def test_answer_token_span_rejects_answers_cut_by_the_window(tokenizer, vocab) -> None:
    questions, _ = read_squad(FIXTURE)
    question = questions[0]  # "Saint Bernadette Soubirous": 8 WordPieces in this vocabulary
    answer = question.answers[0]
    options = WindowOptions(max_seq_length=24, doc_stride=3, max_query_length=8)
    features = squad_features([question], tokenizer, vocab, options)
    spans = [answer_token_span(w, answer.start, answer.start + len(answer.text))
             for w in features.windows]
    assert any(s != (0, 0) for s in spans)
    cut = [w for w in features.windows
           if any(sp is not None and sp[0] <= answer.start < sp[1] for sp in w.spans)
           and not any(sp is not None and sp[1] >= answer.start + len(answer.text)
                       for sp in w.spans)]
    assert cut and all(answer_token_span(w, answer.start, answer.start + len(answer.text))
                       == (0, 0) for w in cut)


def test_bad_files_and_options_are_one_line_errors(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.errors import UsageError

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(UsageError, match=r"bad.json: data\[0\].paragraphs\[0\]: missing "
                                         r"'context'"):
        read_squad(bad)
    with pytest.raises(UsageError, match="leaves no room"):
        WindowOptions(max_seq_length=32, max_query_length=30).validate()
    (tmp_path / "p.json").write_text("{}")
    assert cli.main(["evaluate", "squad", "--data", str(bad), "--predictions",
                     str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing 'context'" in err[0]


# ----------------------------------------------------------------------------------------------
# Decoding


def gold_logits(features, questions) -> tuple[np.ndarray, np.ndarray]:
    """Logits that peak at each window's labelled answer (and favour nothing else)."""
    n, seq = features.arrays["input_ids"].shape
    rng = np.random.default_rng(0)
    start = rng.normal(0, 0.1, (n, seq)).astype(np.float32)
    end = rng.normal(0, 0.1, (n, seq)).astype(np.float32)
    for w in range(n):
        s, e = features.arrays["start_positions"][w], features.arrays["end_positions"][w]
        if s:
            start[w, s] += 10.0
            end[w, e] += 10.0
    return start, end


def test_decoding_gold_logits_gives_the_gold_answers(tokenizer, vocab) -> None:
    questions, dataset = read_squad(FIXTURE)
    options = WindowOptions(max_seq_length=64, doc_stride=24, max_query_length=16)
    features = squad_features(questions, tokenizer, vocab, options, training=True)
    start, end = gold_logits(features, questions)
    predictions, nbest = decode_answers(questions, features.windows, start, end,
                                        n_best_size=5, max_answer_length=30)
    # Answers are whole tokens of the context: AllenNLP's cut "Father Julius Nieuwl" ends
    # inside the bundled vocabulary's last WordPiece, so the best span is the whole word.
    gold = {q.id: q.answers[0].text for q in questions}
    gold["5733b1da4776f4190066106b"] = "Father Julius Nieuwland"
    assert predictions == gold
    assert evaluate(dataset["data"], predictions) == pytest.approx(
        {"exact_match": 80.0, "f1": 100.0 * (4 + 2 / 3) / 5})  # 2 of 3 tokens in common
    for candidates in nbest.values():
        assert 1 < len(candidates) <= 5
        assert sum(c.probability for c in candidates) == pytest.approx(1.0)
        assert len({c.text for c in candidates}) == len(candidates)
        assert [c.score for c in candidates] == sorted((c.score for c in candidates),
                                                       reverse=True)
    # A maximum answer length shorter than the gold spans forbids them.
    short, _ = decode_answers(questions, features.windows, start, end, 5, 1)
    assert all(len(tokenizer.encode(t, add_special_tokens=False).ids) <= 1
               for t in short.values())
    assert short != predictions


def test_no_valid_span_gives_an_empty_answer(tokenizer, vocab) -> None:
    questions, _ = read_squad(FIXTURE)
    features = squad_features(questions[:1], tokenizer, vocab, WindowOptions(64, 24, 16))
    n, seq = features.arrays["input_ids"].shape
    start = np.zeros((n, seq), np.float32)
    end = np.zeros((n, seq), np.float32)
    start[:, 0] = end[:, 0] = 50.0  # only [CLS] and the question: never an answer
    start[:, 1:] = -50.0
    end[:, 1:] = -50.0
    predictions, nbest = decode_answers(questions[:1], features.windows, start, end, 1, 30)
    assert predictions == {questions[0].id: ""}
    assert nbest[questions[0].id][0].probability == 1.0


# ----------------------------------------------------------------------------------------------
# The official v1.1 metric, transcribed as plainly as possible (evaluate-v1.1.py)


def official_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def official_f1_score(prediction, ground_truth):
    prediction_tokens = official_normalize_answer(prediction).split()
    ground_truth_tokens = official_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1


def official_exact_match_score(prediction, ground_truth):
    return official_normalize_answer(prediction) == official_normalize_answer(ground_truth)


def official_metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
    scores_for_ground_truths = []
    for ground_truth in ground_truths:
        score = metric_fn(prediction, ground_truth)
        scores_for_ground_truths.append(score)
    return max(scores_for_ground_truths)


def official_evaluate(dataset, predictions):
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                ground_truths = list(map(lambda x: x["text"], qa["answers"]))
                prediction = predictions[qa["id"]]
                exact_match += official_metric_max_over_ground_truths(
                    official_exact_match_score, prediction, ground_truths)
                f1 += official_metric_max_over_ground_truths(
                    official_f1_score, prediction, ground_truths)
    exact_match = 100.0 * exact_match / total
    f1 = 100.0 * f1 / total
    return {"exact_match": exact_match, "f1": f1}


# (prediction, gold answers): articles, punctuation, case, whitespace, several golds, empty.
EDGE_CASES = [
    ("the Eiffel Tower", ["Eiffel Tower"]),
    ("An apple a day", ["apple day"]),
    ("theater", ["the ater"]),  # "the" inside a word is not an article
    ("Saint-Bernadette, Soubirous!", ["Saint Bernadette Soubirous"]),
    ("Saint Bernadette Soubirous", ["saint-bernadette soubirous"]),
    ("“quoted” text", ['"quoted" text']),  # curly quotes are not string.punctuation
    ("  spaced \t out\n", ["spaced out"]),
    ("1858", ["in 1858", "1858", "the year 1858"]),
    ("a golden statue", ["golden statue of the Virgin Mary", "a copper statue"]),
    ("statue statue statue", ["statue of Mary"]),  # repeated tokens count once each
    ("", ["Notre Dame"]),
    ("", ["the"]),  # normalises to "" == "": exact match 1, F1 0
    ("", [""]),
    ("The", ["a"]),
    ("Mary", []),  # no gold answer: the official max() would fail; popbert scores 0
    ("naïve café", ["naive cafe"]),
    ("U.S.", ["US"]),
    ("3.5%", ["35"]),
]


@pytest.mark.parametrize("prediction,golds", EDGE_CASES)
def test_metric_agrees_with_the_official_rules(prediction: str, golds: list[str]) -> None:
    for gold in golds:
        assert normalize_answer(gold) == official_normalize_answer(gold)
        assert exact_match_score(prediction, gold) == official_exact_match_score(prediction,
                                                                                 gold)
        assert f1_score(prediction, gold) == official_f1_score(prediction, gold)
    if golds:
        dataset = [{"paragraphs": [{"qas": [{"id": "q", "answers": [{"text": g}
                                                                    for g in golds]}]}]}]
        assert evaluate(dataset, {"q": prediction}) == official_evaluate(dataset,
                                                                         {"q": prediction})


def test_evaluate_counts_unanswered_questions_as_zero() -> None:
    questions, dataset = read_squad(FIXTURE)
    predictions = {questions[0].id: questions[0].answers[0].text,
                   questions[1].id: "golden statue of the Virgin Mary, on the dome"}
    ours = evaluate(dataset["data"], predictions)
    assert ours == official_evaluate(dataset["data"], predictions)
    assert ours["exact_match"] == pytest.approx(20.0)
    assert 20.0 < ours["f1"] < 40.0


def test_evaluate_command_prints_the_official_json(tmp_path: Path) -> None:
    questions, dataset = read_squad(FIXTURE)
    predictions = {q.id: q.answers[0].text.upper() for q in questions[:4]}
    (tmp_path / "predictions.json").write_text(json.dumps(predictions))
    result = subprocess.run([sys.executable, "-m", "popbert", "evaluate", "squad", "--data",
                             str(FIXTURE), "--predictions", str(tmp_path / "predictions.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert json.loads(last) == official_evaluate(dataset["data"], predictions)
    assert list(json.loads(last)) == ["exact_match", "f1"]
    assert json.loads(last)["exact_match"] == pytest.approx(80.0)


# ----------------------------------------------------------------------------------------------
# Fine-tuning the real MiniLM checkpoint, then serving it


@pytest.mark.e2e
def test_finetuning_minilm_overfits_the_fixture_and_serves_it(tmp_path: Path,
                                                              minilm_imported: Path) -> None:
    imported, run = minilm_imported, tmp_path / "squad"
    # Few examples, one 192-token window per question, no dropout, a high learning rate.
    assert cli.main(["finetune", "squad", "--checkpoint", str(imported), "--train",
                     str(FIXTURE), "--predict", str(FIXTURE), "--output-dir", str(run),
                     "--max-seq-length", "192", "--epochs", "12", "--batch-size", "5",
                     "--lr", "5e-4", "--warmup-proportion", "0", "--dropout", "0",
                     "--log-every", "6"]) == 0
    results = json.loads((run / "eval_results.json").read_text())
    assert results == {"exact_match": 100.0, "f1": 100.0}
    predictions = json.loads((run / "predictions.json").read_text())
    questions, _ = read_squad(FIXTURE)
    assert predictions == {q.id: q.answers[0].text for q in questions}
    records = (run / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in records]
    assert losses[-1] < losses[0] / 4

    model = tmp_path / "squad.onnx"
    assert cli.main(["export", "--checkpoint", str(run), "--task", "squad", "--output",
                     str(model)]) == 0
    served = tmp_path / "served.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "popbert", "predict", "squad", "--model",
                             str(model), "--data", str(FIXTURE), "--output", str(served)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(served.read_text()) == predictions
    result = subprocess.run([sys.executable, "-m", "popbert", "evaluate", "squad", "--data",
                             str(FIXTURE), "--predictions", str(served)],
                            capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"exact_match": 100.0,
                                                                  "f1": 100.0}


def test_what_training_leaves_out_is_counted_in_one_line_each(tokenizer, vocab, caplog) -> None:
    """Questions skipped (no answer; an answer not at its answer_start) and answers that no
    window holds are each said once, with their count, not once per question."""
    questions, _ = read_squad(FIXTURE)
    first = questions[0]
    broken = [Question("no-answer", first.question, first.context),
              Question("moved", first.question, first.context,
                       [Answer(first.answers[0].text, first.answers[0].start + 1)])]
    options = WindowOptions(max_seq_length=24, doc_stride=8, max_query_length=8)
    with caplog.at_level("WARNING", logger="popbert"):
        features = squad_features([*questions, *broken], tokenizer, vocab, options,
                                  training=True, source="train.json")
    lines = [r.getMessage() for r in caplog.records]
    assert "train.json: 1 of 7 questions skipped for training: no answer (no-answer)" in lines
    assert ("train.json: 1 of 7 questions skipped for training: the answer is not at its "
            "answer_start (moved)") in lines
    starts = features.arrays["start_positions"]
    unlabelled = [q.id for i, q in enumerate(features.questions)
                  if not any(starts[w] for w, window in enumerate(features.windows)
                             if window.question_index == i)]
    assert unlabelled  # 24-token windows leave some answers in no window
    said = [line for line in lines if "in no window of 24 tokens" in line]
    assert len(said) == 1 and said[0].startswith(f"train.json: {len(unlabelled)} of 5 questions")
