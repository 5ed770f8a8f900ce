"""Token classification data: CoNLL/JSONL reading, tag schemes, windows, decoding, entity F1.

The fixture is tests/fixtures/ner/sample.conll (CoNLL-2003 layout, written for these tests, see
its README). Entity scores are checked against seqeval itself on random tag sequences.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
from seqeval.metrics import classification_report, f1_score, precision_score, recall_score

from popbert.data.errors import DataError
from popbert.data.token_classification import (
    IGNORE_INDEX,
    TaggedData,
    decode_tags,
    encode_tagged,
    entity_metrics,
    label_list,
    read_tagged,
    write_conll,
)
from popbert.data.tokenization import bundled_vocab_path, load_tokenizer

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ner" / "sample.conll"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_vocab_path(), True)


def _to_iob1(tags: list[str]) -> list[str]:
    """IOB2 → IOB1: B- only where an entity follows one of its own type."""
    out = []
    for i, tag in enumerate(tags):
        if tag.startswith("B-") and not (i and tags[i - 1] != "O" and
                                         tags[i - 1][2:] == tag[2:]):
            tag = "I-" + tag[2:]
        out.append(tag)
    return out


def _to_bioes(tags: list[str]) -> list[str]:
    """IOB2 → BIOES: S- for one-word entities, E- on an entity's last word."""
    out = []
    for i, tag in enumerate(tags):
        following = tags[i + 1] if i + 1 < len(tags) else "O"
        continues = following == "I-" + tag[2:]
        if tag.startswith("B-"):
            tag = tag if continues else "S-" + tag[2:]
        elif tag.startswith("I-"):
            tag = tag if continues else "E-" + tag[2:]
        out.append(tag)
    return out


def _write_conll_text(path: Path, sentences: list[list[str]], tags: list[list[str]]) -> Path:
    path.write_text("\n\n".join("\n".join(f"{w} {t}" for w, t in zip(ws, ts))
                                for ws, ts in zip(sentences, tags)) + "\n")
    return path


def _one_line_error(call, *fragments: str) -> str:
    with pytest.raises(DataError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ----------------------------------------------------------------------------------------------
# Reading


def test_conll_fixture_and_jsonl_read_alike(tmp_path: Path) -> None:
    conll = read_tagged(FIXTURE)
    assert [s.line for s in conll.sentences] == [3, 15, 29, 43]  # -DOCSTART- and blanks skipped
    assert conll.sentences[0].words[:3] == ["Maria", "Lindqvist", "flew"]
    assert conll.sentences[0].tags[:3] == ["B-PER", "I-PER", "O"]
    assert conll.sentences[0].columns[1] == ["Lindqvist", "NNP", "I-NP", "I-PER"]
    assert conll.sentences[3].tags == ["B-LOC", "B-LOC", "O", "B-LOC"]  # no trailing blank line
    assert (conll.scheme, conll.source_scheme) == ("IOB2", "IOB2")

    rows = [json.dumps({"tokens": s.words, "tags": s.tags}) for s in conll.sentences]
    jsonl = tmp_path / "sample.jsonl"
    jsonl.write_text("\n".join(rows[:2]) + "\n\n" + "\n".join(rows[2:]) + "\n")
    data = read_tagged(jsonl)
    assert [s.words for s in data.sentences] == [s.words for s in conll.sentences]
    assert [s.tags for s in data.sentences] == [s.tags for s in conll.sentences]
    assert [s.line for s in data.sentences] == [1, 2, 4, 5]
    assert data.sentences[0].columns is None

    tabs = tmp_path / "tabs.tsv"  # tab-separated: words may hold spaces
    tabs.write_text("New York\tNNP\tB-LOC\nis\tVBZ\tO\n")
    assert read_tagged(tabs).sentences[0].words == ["New York", "is"]


def test_iob1_and_bioes_are_normalised_to_iob2(tmp_path: Path) -> None:
    words = [list("abcdefg")]
    iob1 = _write_conll_text(tmp_path / "iob1.conll", words,
                             [["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-ORG", "I-ORG"]])
    data = read_tagged(iob1)
    assert data.source_scheme == "IOB1" and data.scheme == "IOB2"
    assert data.sentences[0].tags == ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "B-ORG", "I-ORG"]

    bioes = _write_conll_text(tmp_path / "bioes.conll", words,
                              [["S-PER", "B-LOC", "I-LOC", "E-LOC", "O", "S-ORG", "S-ORG"]])
    data = read_tagged(bioes)
    assert data.source_scheme == "BIOES"
    assert data.sentences[0].tags == ["B-PER", "B-LOC", "I-LOC", "I-LOC", "O", "B-ORG", "B-ORG"]
    assert read_tagged(bioes, scheme="iobes").source_scheme == "BIOES"

    # The fixture converted by the usual converters comes back as the fixture, detected or named.
    gold = read_tagged(FIXTURE)
    for scheme, convert in (("IOB1", _to_iob1), ("BIOES", _to_bioes)):
        path = _write_conll_text(tmp_path / f"{scheme}.conll",
                                 [s.words for s in gold.sentences],
                                 [convert(s.tags) for s in gold.sentences])
        for given in (None, scheme):
            data = read_tagged(path, scheme=given)
            assert data.source_scheme == scheme
            assert [s.tags for s in data.sentences] == [s.tags for s in gold.sentences]

    # An "IOB2" file with an entity starting I- reads as conlleval does: B- there.
    loose = _write_conll_text(tmp_path / "loose.conll", [list("abc")], [["O", "I-PER", "I-PER"]])
    assert read_tagged(loose, scheme="IOB2").sentences[0].tags == ["O", "B-PER", "I-PER"]
    io = _write_conll_text(tmp_path / "io.conll", [list("abcd")],
                           [["I-PER", "I-PER", "O", "I-LOC"]])
    assert read_tagged(io, scheme="IO").sentences[0].tags == ["B-PER", "I-PER", "O", "B-LOC"]


def test_prediction_input_without_tags(tmp_path: Path) -> None:
    words = tmp_path / "words.txt"
    words.write_text("-DOCSTART-\n\nHello\nworld\n\n\nBye\n")
    data = read_tagged(words, require_tags=False)
    assert [s.words for s in data.sentences] == [["Hello", "world"], ["Bye"]]
    assert all(s.tags is None for s in data.sentences) and not data.has_tags
    _one_line_error(lambda: read_tagged(words), f"{words}:3", "one column")

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"tokens": ["a", "b"]}\n{"tokens": []}\n{"tokens": ["c"]}\n')
    data = read_tagged(rows, require_tags=False)
    assert [s.words for s in data.sentences] == [["a", "b"], ["c"]]  # no empty sentences
    assert data.sentences[1].tags is None
    _one_line_error(lambda: read_tagged(rows), f"{rows}:1", "tags")
    # A tagged file still reads its tags as prediction input.
    assert read_tagged(FIXTURE, require_tags=False).sentences[0].tags[0] == "B-PER"


@pytest.mark.parametrize("name, text, scheme, fragments", [
    ("columns.conll", "EU NNP B-ORG\nrejects VBZ O\nGerman JJ\n", None,
     [":3:", "2 columns", "line 1"]),
    ("mixed.conll", "EU B-ORG\n\nrejects\n", None, [":3:", "line 1"]),
    ("scheme.conll", "EU B-ORG\n", "BILOU", ["unknown tag scheme 'BILOU'"]),
    ("tag.conll", "EU B-ORG\nrejects B_PER\n", None, [":2:", "'B_PER'"]),
    ("empty-type.conll", "EU B-\n", None, [":1:", "'B-'"]),
    ("not-iob2.conll", "EU S-ORG\n", "IOB2", [":1:", "'S-ORG'", "not IOB2"]),
    ("lengths.jsonl", '{"tokens": ["a"], "tags": ["O"]}\n{"tokens": ["a", "b"], "tags": ["O"]}\n',
     None, [":2:", "2 tokens but 1 tags"]),
    ("empty.jsonl", '{"tokens": ["a", ""], "tags": ["O", "O"]}\n', None, [":1:", "token 1"]),
    ("empty.tsv", "EU\tB-ORG\n\tO\n", None, [":2:", "empty word"]),
    ("invalid.jsonl", '{"tokens": ["a"], "tags": ["O"]}\n{"tokens": \n', None,
     [":2:", "invalid JSON"]),
    ("nothing.conll", "-DOCSTART- O\n\n\n", None, ["no sentences"]),
    ("words.csv", "a,O\n", None, ["unknown format '.csv'"]),
])
def test_bad_input_is_one_line(tmp_path: Path, name: str, text: str, scheme: str | None,
                               fragments: list[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    message = _one_line_error(lambda: read_tagged(path, scheme=scheme), *fragments)
    assert message.startswith(str(path))


def test_label_list() -> None:
    data = read_tagged(FIXTURE)
    assert label_list(data) == ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG",
                                "B-PER", "I-PER"]


# ----------------------------------------------------------------------------------------------
# Model inputs and decoding


def test_first_piece_labels(tokenizer) -> None:
    data = read_tagged(FIXTURE)
    labels = label_list(data)
    arrays, windows = encode_tagged(data, tokenizer, labels, 48)
    assert set(arrays) == {"input_ids", "segment_ids", "input_mask", "labels"}
    assert all(a.shape == (4, 48) and a.dtype == np.int64 for a in arrays.values())
    assert not arrays["segment_ids"].any()
    for row, sentence in enumerate(data.sentences):
        pieces = [tokenizer.encode(w) for w in sentence.words]
        ids = [tokenizer.cls_id, *[p for word in pieces for p in word], tokenizer.sep_id]
        expected = [IGNORE_INDEX]
        for word, tag in zip(pieces, sentence.tags):
            expected += [labels.index(tag)] + [IGNORE_INDEX] * (len(word) - 1)
        expected.append(IGNORE_INDEX)
        pad = 48 - len(ids)
        assert arrays["input_ids"][row].tolist() == ids + [tokenizer.pad_id] * pad
        assert arrays["input_mask"][row].tolist() == [1] * len(ids) + [0] * pad
        assert arrays["labels"][row].tolist() == expected + [IGNORE_INDEX] * pad
        assert windows[row].sentence == row and windows[row].owned == list(range(len(pieces)))
    assert any(len(tokenizer.encode(w)) > 1 for w in data.sentences[0].words)

    # Without labels, or without tags, there is no labels array.
    assert "labels" not in encode_tagged(data, tokenizer, None, 48)[0]
    words_only = TaggedData(data.path, [type(s)(s.words, None, s.line) for s in data.sentences],
                            "IOB2", "IOB2")
    assert "labels" not in encode_tagged(words_only, tokenizer, labels, 48)[0]


def test_label_all_subtokens(tokenizer) -> None:
    data = read_tagged(FIXTURE)
    labels = label_list(data)
    arrays, windows = encode_tagged(data, tokenizer, labels, 48, label_all_subtokens=True)
    for row, sentence in enumerate(data.sentences):
        expected = [IGNORE_INDEX]
        for word, tag in zip(sentence.words, sentence.tags):
            later = "I-" + tag[2:] if tag != "O" else "O"
            expected += [labels.index(tag)] + [labels.index(later)] * (len(tokenizer.encode(word))
                                                                       - 1)
        assert arrays["labels"][row, :len(expected) + 1].tolist() == expected + [IGNORE_INDEX]
    # "Lindqvist" (I-PER) has several pieces, all I-PER; "Stockholm" (B-LOC): B-LOC then I-LOC.
    first = arrays["labels"][0].tolist()
    assert first[2:7] == [labels.index("I-PER")] * 5
    assert first[11:15] == [labels.index("B-LOC")] + [labels.index("I-LOC")] * 3


def test_unseen_tag_names_its_line(tokenizer) -> None:
    data = read_tagged(FIXTURE)
    labels = [name for name in label_list(data) if not name.endswith("MISC")]
    _one_line_error(lambda: encode_tagged(data, tokenizer, labels, 48),
                    f"{FIXTURE}:29:", "'B-MISC'", "training never saw")


@pytest.mark.parametrize("max_seq_length, stride", [(12, None), (16, None), (16, 3), (16, 14),
                                                    (7, 1)])
def test_long_sentences_span_windows_and_decode_back(tokenizer, tmp_path: Path,
                                                     max_seq_length: int,
                                                     stride: int | None) -> None:
    rng = random.Random(max_seq_length * 100 + (stride or 0))
    gold = read_tagged(FIXTURE)
    vocabulary = [(w, t) for s in gold.sentences for w, t in zip(s.words, s.tags)]
    sentences = [gold.sentences[0].words + gold.sentences[1].words]
    tags = [gold.sentences[0].tags + gold.sentences[1].tags]
    for length in (1, 3, 40, 75):
        pairs = [rng.choice(vocabulary) for _ in range(length)]
        sentences.append([w for w, _ in pairs])
        tags.append(read_tagged(_write_conll_text(tmp_path / "t.conll", [sentences[-1]],
                                                  [[t for _, t in pairs]])).sentences[0].tags)
    data = read_tagged(_write_conll_text(tmp_path / "long.conll", sentences, tags))
    labels = label_list(gold)
    capacity = max_seq_length - 2
    arrays, windows = encode_tagged(data, tokenizer, labels, max_seq_length, stride=stride)
    assert len(windows) == len(arrays["input_ids"]) > len(sentences)

    for s, sentence in enumerate(data.sentences):
        rows = [i for i, w in enumerate(windows) if w.sentence == s]
        pieces = [tokenizer.encode(w)[:capacity] for w in sentence.words]
        labelled = np.zeros(len(pieces), int)
        previous_start = -1
        for row in rows:
            window = windows[row]
            assert window.first_word > previous_start  # windows move on
            previous_start = window.first_word
            span = range(window.first_word, window.last_word + 1)
            ids = [tokenizer.cls_id, *[p for w in span for p in pieces[w]], tokenizer.sep_id]
            assert len(ids) <= max_seq_length  # whole words, at most the row
            assert arrays["input_ids"][row, :len(ids)].tolist() == ids
            assert arrays["input_mask"][row].sum() == len(ids)
            positions = np.flatnonzero(arrays["labels"][row] != IGNORE_INDEX)
            words = window.word_ids[positions].tolist()
            assert words == window.owned and all(window.first_piece[positions])
            for position, w in zip(positions, words):
                assert arrays["labels"][row, position] == labels.index(sentence.tags[w])
                labelled[w] += 1
        assert labelled.tolist() == [1] * len(pieces)  # each word labelled in exactly one window
        assert windows[rows[0]].first_word == 0
        assert windows[rows[-1]].last_word == len(pieces) - 1
        for a, b in zip(rows, rows[1:]):  # consecutive windows overlap or at least touch
            assert windows[b].first_word <= windows[a].last_word + 1

    # Gold ids where the labels are, random ids everywhere else: the gold tags come back.
    noise = np.random.default_rng(0).integers(0, len(labels), arrays["labels"].shape)
    predictions = np.where(arrays["labels"] == IGNORE_INDEX, noise, arrays["labels"])
    assert decode_tags(data, windows, predictions, labels) == [s.tags for s in data.sentences]
    if stride is None:  # split sentences were said once
        assert max(len(s.words) for s in data.sentences) > capacity


def test_max_context_owner(tokenizer, tmp_path: Path) -> None:
    # Ten one-piece words, rows of 6 pieces, stride 2: windows 0-5, 2-7, 4-9; a word belongs to
    # the window where its nearer edge is furthest away, the earlier window on a tie (word 3 has
    # one word on its nearer side in windows 0-5 and 2-7; word 5 has two in 2-7, one in 4-9).
    path = tmp_path / "ten.conll"
    path.write_text("".join(f"{w} O\n" for w in "the a of to in and on for is it".split()))
    data = read_tagged(path)
    _, windows = encode_tagged(data, tokenizer, ["O"], 8, stride=2)
    assert [(w.first_word, w.last_word) for w in windows] == [(0, 5), (2, 7), (4, 9)]
    assert [w.owned for w in windows] == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]


def test_words_without_pieces_and_overlong_words(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"tokens": ["a", "\u200b", "Lindqvist", "b"],
                                "tags": ["O", "B-PER", "B-LOC", "O"]}) + "\n")
    data = read_tagged(path)
    labels = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    arrays, windows = encode_tagged(data, tokenizer, labels, 5)  # 3 pieces a row
    assert arrays["input_ids"][0, 2] == tokenizer.unk_id  # the zero-width space
    lindqvist = [w for w in windows if 2 in w.owned][0]
    assert lindqvist.word_ids.tolist().count(2) == 3  # cut to the row, first piece kept
    predictions = np.where(arrays["labels"] == IGNORE_INDEX, 0, arrays["labels"])
    assert decode_tags(data, windows, predictions, labels) == [data.sentences[0].tags]
    _one_line_error(lambda: encode_tagged(data, tokenizer, labels, 8, stride=7), "stride")
    _one_line_error(lambda: decode_tags(data, windows, predictions[:-1], labels), "shape")


# ----------------------------------------------------------------------------------------------
# Entity scores


def _random_tags(rng: random.Random, length: int) -> list[str]:
    types = ["PER", "LOC", "ORG"]
    tags = []
    for _ in range(length):
        roll = rng.random()
        if roll < 0.35:
            tags.append("O")
        elif roll < 0.6:
            tags.append("B-" + rng.choice(types))
        elif roll < 0.97:  # often I- after O or after another type (ill-formed)
            previous = tags[-1][2:] if tags and tags[-1] != "O" and rng.random() < 0.6 else None
            tags.append("I-" + (previous or rng.choice(types)))
        elif roll < 0.985:
            tags.append(rng.choice(["S-", "E-"]) + rng.choice(types))
        else:  # tags without a type (seqeval reads their type as "_")
            tags.append(rng.choice(["B", "I", "E", "S"]))
    return tags


def test_entity_metrics_equal_seqeval() -> None:
    rng = random.Random(1234)
    for trial in range(400):
        lengths = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        gold = [_random_tags(rng, n) for n in lengths]
        predicted = [list(s) for s in gold]
        for sentence in predicted:  # perturb some tags so predictions are near the gold
            for i in range(len(sentence)):
                if rng.random() < 0.3:
                    sentence[i] = _random_tags(rng, 1)[0]
        if trial % 10 == 0:
            predicted = [_random_tags(rng, n) for n in lengths]
        ours = entity_metrics(gold, predicted)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = (precision_score(gold, predicted), recall_score(gold, predicted),
                      f1_score(gold, predicted))
            report = classification_report(gold, predicted, output_dict=True)
        assert ours["precision"] == pytest.approx(theirs[0], abs=1e-12, rel=0)
        assert ours["recall"] == pytest.approx(theirs[1], abs=1e-12, rel=0)
        assert ours["f1"] == pytest.approx(theirs[2], abs=1e-12, rel=0)
        types = {k: v for k, v in report.items() if not k.endswith(" avg")}
        assert set(ours["per_type"]) == set(types)
        for name, row in types.items():
            mine = ours["per_type"][name]
            for ours_key, their_key in (("precision", "precision"), ("recall", "recall"),
                                        ("f1", "f1-score")):
                assert mine[ours_key] == pytest.approx(float(row[their_key]), abs=1e-12, rel=0)
            assert mine["support"] == int(row["support"])


def test_entity_metrics_examples() -> None:
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG"]]
    predicted = [["B-PER", "I-PER", "O", "I-LOC"], ["B-ORG", "I-ORG"]]  # I-LOC after O starts one
    scores = entity_metrics(gold, predicted)
    assert (scores["precision"], scores["recall"]) == (2 / 3, 2 / 3)
    assert scores["per_type"]["ORG"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert entity_metrics([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0,
                                                "per_type": {}}
    _one_line_error(lambda: entity_metrics([["O"]], [["O", "O"]]), "differ")


# ----------------------------------------------------------------------------------------------
# Writing


def test_write_conll_reads_back(tmp_path: Path) -> None:
    data = read_tagged(FIXTURE)
    predicted = [["O"] * len(s.words) for s in data.sentences]
    predicted[0][:2] = ["B-ORG", "I-ORG"]
    predicted[3] = ["B-LOC", "I-LOC", "O", "B-MISC"]
    out = tmp_path / "predicted.conll"
    write_conll(out, data, predicted)
    assert out.read_text().splitlines()[:2] == ["Maria NNP B-NP B-PER B-ORG",
                                                "Lindqvist NNP I-NP I-PER I-ORG"]
    back = read_tagged(out)
    assert [s.words for s in back.sentences] == [s.words for s in data.sentences]
    assert [s.tags for s in back.sentences] == predicted
    assert back.sentences[0].columns[0][:-1] == data.sentences[0].columns[0]

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"tokens": ["New York", "is", "big"]}\n{"tokens": ["Hi"]}\n')
    words = read_tagged(rows, require_tags=False)
    write_conll(tmp_path / "rows.conll", words, [["B-LOC", "O", "O"], ["O"]])
    back = read_tagged(tmp_path / "rows.conll")
    assert [s.words for s in back.sentences] == [["New York", "is", "big"], ["Hi"]]
    assert [s.tags for s in back.sentences] == [["B-LOC", "O", "O"], ["O"]]
    _one_line_error(lambda: write_conll(tmp_path / "bad.conll", words, [["O"]]), "1 tag")
