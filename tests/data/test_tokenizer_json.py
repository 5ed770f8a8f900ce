"""Any Hugging Face `tokenizer.json` behind the one tokenizer interface, against `transformers`.

A byte-level BPE trained on the bundled Wikipedia slice (`prepare-data vocab --model bpe`, the
kind ModernBERT ships), a WordPiece `tokenizer.json` and a Unigram one: popbert's ids equal
`transformers.AutoTokenizer`'s on real text, the special roles are read from the file, and
pre-training data is made with it. Bad files are one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from popbert.cli.main import main
from popbert.data.errors import DataError
from popbert.data.tokenization import (
    SPECIAL_TOKENS,
    JsonTokenizer,
    WordPieceTokenizer,
    bundled_corpus_path,
    bundled_vocab_path,
    load_tokenizer,
    make_tokenizer,
    parse_vocab,
    read_vocab_text,
    tokenizer_from_text,
)
from popbert.data.vocab import train_bpe


def corpus_lines(count: int = 300) -> list[str]:
    lines = [line.strip() for line in bundled_corpus_path().read_text(encoding="utf-8")
             .splitlines() if line.strip()]
    return lines[:count]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe([bundled_corpus_path()], path, vocab_size=2000)
    return path


def transformers_ids(tokenizer_file: Path, lines: list[str]) -> list[list[int]]:
    """`AutoTokenizer` on a directory holding only this tokenizer.json."""
    import shutil

    import transformers

    directory = tokenizer_file.parent / f"hf-{tokenizer_file.stem}"
    directory.mkdir(exist_ok=True)
    shutil.copyfile(tokenizer_file, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    return [hf(line, add_special_tokens=False)["input_ids"] for line in lines]


def test_trained_bpe_ids_equal_autotokenizer_on_real_text(bpe_file: Path) -> None:
    tokenizer = load_tokenizer(bpe_file)
    assert isinstance(tokenizer, JsonTokenizer)
    assert tokenizer.roles == {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # ids 0-4
    assert tokenizer.vocab_size == 2000
    lines = corpus_lines()
    assert tokenizer.encode_batch(lines) == transformers_ids(bpe_file, lines)
    assert tokenizer.unk_id not in {i for ids in tokenizer.encode_batch(lines) for i in ids}
    # Byte-level: a word-initial piece starts with "Ġ"; the rest of a word continues it.
    word = tokenizer.encode(" tokenization")
    assert [bool(tokenizer.is_continuation[i]) for i in word] == [False] + [True] * (
        len(word) - 1)
    assert not tokenizer.is_continuation[list(tokenizer.special_ids)].any()


def test_wordpiece_and_unigram_tokenizer_json_files(tmp_path: Path) -> None:
    """A WordPiece tokenizer.json gives exactly the vocab.txt's ids; a Unigram one (trained
    here) gives AutoTokenizer's."""
    lines = corpus_lines(200)
    vocab = parse_vocab(read_vocab_text(bundled_vocab_path()))
    wordpiece = tmp_path / "wordpiece.json"
    wordpiece.write_text(make_tokenizer(vocab, lowercase=True).to_str())
    from_json = load_tokenizer(wordpiece)
    assert from_json.encode_batch(lines) == WordPieceTokenizer().encode_batch(lines)
    assert from_json.roles == WordPieceTokenizer().roles
    assert from_json.is_continuation.tolist() == WordPieceTokenizer().is_continuation.tolist()

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.train([str(bundled_corpus_path())], trainers.UnigramTrainer(
        vocab_size=800, special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<mask>"],
        unk_token="<unk>", show_progress=False))
    path = tmp_path / "unigram.json"
    unigram.save(str(path))
    tokenizer = load_tokenizer(path)
    assert tokenizer.roles == {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert tokenizer.encode_batch(lines) == transformers_ids(path, lines)


def test_an_export_carries_the_tokenizer_text(bpe_file: Path) -> None:
    text = bpe_file.read_text(encoding="utf-8")
    tokenizer = tokenizer_from_text(text, source="metadata")
    assert tokenizer.encode("A sentence.") == load_tokenizer(bpe_file).encode("A sentence.")
    assert tokenizer.vocab_sha256 == load_tokenizer(bpe_file).vocab_sha256


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe not utf-8", "not UTF-8 text"),
    (b"{\"model\": ", "not a Hugging Face tokenizer.json"),
    (b"[1, 2]", "not a Hugging Face tokenizer.json"),
])
def test_a_bad_tokenizer_file_is_one_line_naming_it(tmp_path: Path, content: bytes,
                                                    expected: str) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected) as raised:
        load_tokenizer(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_tokenizer_without_special_tokens_names_them(tmp_path: Path) -> None:
    bare = Tokenizer(models.BPE())
    bare.add_tokens(["[PAD]", "[CLS]"])
    path = tmp_path / "tokenizer.json"
    bare.save(str(path))
    with pytest.raises(DataError, match=r"lacks special tokens \[UNK\] or <unk>, \[SEP\]"):
        load_tokenizer(path)


def test_prepare_data_vocab_trains_bpe_and_checks_the_suffix(tmp_path: Path) -> None:
    output = tmp_path / "tokenizer.json"
    assert main(["prepare-data", "vocab", "--input", str(bundled_corpus_path()), "--model",
                 "bpe", "--vocab-size", "1000", "--output", str(output)]) == 0
    assert load_tokenizer(output).vocab_size == 1000
    assert main(["prepare-data", "vocab", "--input", str(bundled_corpus_path()), "--model",
                 "bpe", "--output", str(tmp_path / "vocab.txt")]) == 2
    assert not (tmp_path / "vocab.txt").exists()


def test_pretraining_instances_from_a_tokenizer_json(bpe_file: Path) -> None:
    """The bundled corpus made into MLM rows with the BPE tokenizer: every id is one of its
    ids, rows start with its [CLS], masked positions hold its [MASK] most of the time."""
    from popbert.data.loader import load_or_create_instances

    arrays = load_or_create_instances(None, str(bpe_file), sequence_length=64,
                                      max_predictions_per_seq=16, seed=0, next_sentence=False,
                                      cache_dir=bpe_file.parent / "cache")
    tokenizer = load_tokenizer(bpe_file)
    ids = arrays["input_ids"]
    assert ids.max() < tokenizer.vocab_size
    assert (ids[:, 0] == tokenizer.cls_id).all()
    masked = np.take_along_axis(ids, arrays["masked_lm_positions"], axis=1)
    real = arrays["masked_lm_ids"] > 0
    assert (masked[real] == tokenizer.mask_id).mean() > 0.6
