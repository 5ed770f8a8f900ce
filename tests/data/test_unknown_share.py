"""Nothing cut in silence: the share of `[UNK]` tokens of a corpus is counted, warned about
above 2% (a vocabulary that does not fit its corpus is the most expensive silent mistake in
pre-training) and refused under `data.strict` / `--strict`; the sentences stage counts the
articles it drops as too short. Known answers from small real text: the bundled corpus's
documents, with a known number of words the bundled vocabulary cannot spell (Cyrillic)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from popbert.cli.main import main
from popbert.data import DataError, bundled_corpus_path, load_tokenizer
from popbert.data.corpus import UNKNOWN_SHARE_LIMIT, read_documents
from popbert.data.loader import load_or_create_instances
from popbert.data.tokenization import bundled_vocab_path

ALIEN = "жжж"  # one word the bundled WordPiece vocabulary maps to a single [UNK]


def corpus(tmp_path: Path, alien_every: int) -> tuple[Path, int, int]:
    """40 bundled documents with ALIEN after every `alien_every`-th word (0: none); the file,
    its [UNK] count and its token count as the bundled tokenizer makes them."""
    documents = bundled_corpus_path().read_text(encoding="utf-8").split("\n\n")[:40]
    lines = []
    for document in documents:
        sentences = []
        for sentence in document.splitlines():
            words = sentence.split()
            if alien_every:
                words = [w for i, word in enumerate(words, 1)
                         for w in ([word, ALIEN] if i % alien_every == 0 else [word])]
            sentences.append(" ".join(words))
        lines.append("\n".join(sentences))
    path = tmp_path / f"corpus-{alien_every}.txt"
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = load_tokenizer(None)
    ids = [t for s in path.read_text().split("\n") if s.strip()
           for t in tokenizer.encode_batch([s])[0]]
    return path, ids.count(tokenizer.unk_id), len(ids)


def test_the_bundled_corpus_fits_its_vocabulary(tmp_path, caplog):
    path, unknown, total = corpus(tmp_path, 0)
    assert unknown == 0 and total > 1000
    with caplog.at_level(logging.INFO, logger="popbert"):
        read_documents([path], load_tokenizer(None), strict=True)
    assert "(0.00% [UNK])" in caplog.text and "WARNING" not in caplog.text


def test_a_corpus_the_vocabulary_does_not_fit_is_warned_about_or_refused(tmp_path, caplog):
    path, unknown, total = corpus(tmp_path, 5)  # about one token in six is [UNK]
    share = unknown / total
    assert share > UNKNOWN_SHARE_LIMIT and unknown > 100
    with caplog.at_level(logging.WARNING, logger="popbert"):
        read_documents([path], load_tokenizer(None))
    assert f"{share:.1%} of its tokens are [UNK] ({unknown:,} of {total:,}" in caplog.text
    with pytest.raises(DataError, match=r"are \[UNK\].*refused \(strict\)"):
        read_documents([path], load_tokenizer(None), strict=True)
    # Cached instances keep the counts: a second, cached run under strict is refused too.
    cache = tmp_path / "cache"
    load_or_create_instances([str(path)], None, 64, 10, 1, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1
    with pytest.raises(DataError, match="refused"):
        load_or_create_instances([str(path)], None, 64, 10, 1, cache_dir=cache, strict=True)


def test_pretraining_with_data_strict_refuses_it_in_one_line(tmp_path, capsys):
    path, _, _ = corpus(tmp_path, 5)
    assert main(["pretrain", "--set", f"data.input_files=['{path}']", "--set",
                 "data.strict=true", "-o", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("popbert:")]
    assert len(err) == 1 and "[UNK]" in err[0] and "refused (strict)" in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_instances_stage_counts_unknown_tokens_and_strict_leaves_nothing(tmp_path, caplog,
                                                                           capsys):
    path, unknown, total = corpus(tmp_path, 5)
    args = ["prepare-data", "instances", "--input", str(path), "--vocab",
            str(bundled_vocab_path()), "--sequence-length", "64", "--max-predictions", "10",
            "--dupe-factor", "1", "--workers", "1"]
    assert main([*args, "-o", str(tmp_path / "strict"), "--strict"]) == 2
    captured = capsys.readouterr().err
    err = [line for line in captured.splitlines() if line.startswith("popbert:")]
    assert len(err) == 1 and "refused (strict)" in err[0] and "Traceback" not in captured, err
    assert not (tmp_path / "strict").exists()
    with caplog.at_level(logging.WARNING, logger="popbert"):
        assert main([*args, "-o", str(tmp_path / "warned")]) == 0
    assert "are [UNK]" in caplog.text
    record = json.loads((tmp_path / "warned" / "_SUCCESS.json").read_text())
    assert record["stats"]["unknown_token_share_now"] == pytest.approx(unknown / total, abs=1e-6)


def test_the_sentences_stage_counts_the_articles_it_drops(tmp_path, caplog):
    articles = [{"text": "One sentence only."}, {"text": "First one here. And a second."},
                {"text": "Alone."}, {"text": "A. B went home. C came back."}]
    source = tmp_path / "articles.jsonl"
    source.write_text("".join(json.dumps(a) + "\n" for a in articles), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="popbert"):
        assert main(["prepare-data", "sentences", "--input", str(source), "-o",
                     str(tmp_path / "sentences"), "--workers", "1"]) == 0
    record = json.loads((tmp_path / "sentences" / "_SUCCESS.json").read_text())
    assert record["stats"]["documents_dropped_short_now"] == 2
    assert record["stats"]["documents_written_now"] == 2
    assert "2 of 4 articles dropped with fewer than 2 sentences" in caplog.text
