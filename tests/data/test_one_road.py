"""One data road: pre-training on text files named in the config and on `prepare-data
instances` shards of the same files make the same instances for the same seed and settings
(the same pairing, masking, NSP labels, row for row), and the text road caches them where
`data.cache_dir` says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from popbert.config import load_config
from popbert.data import FEATURE_NAMES, InstanceOptions, bundled_corpus_path, read_shard
from popbert.data import loader as loader_mod
from popbert.data.loader import load_or_create_instances
from popbert.data.prepare import create_instances
from popbert.data.pretraining import load_training_data
from popbert.data.tokenization import bundled_vocab_path
from popbert.errors import ConfigError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Two Google-format files of bundled documents (120 and 80 of them)."""
    documents = bundled_corpus_path().read_text(encoding="utf-8").split("\n\n")
    folder = tmp_path_factory.mktemp("corpus")
    files = []
    for name, chosen in (("a.txt", documents[:120]), ("b.txt", documents[120:200])):
        path = folder / name
        path.write_text("\n\n".join(d.strip("\n") for d in chosen) + "\n", encoding="utf-8")
        files.append(path)
    return files


def shards_road(corpus: list[Path], out: Path, options: InstanceOptions) -> dict:
    record = create_instances(corpus, bundled_vocab_path(), out, options, workers=1)
    parts = [read_shard(out / name) for name in record["parts"]]
    assert len(parts) == len(corpus)
    return {name: np.concatenate([p[name] for p in parts]) for name in FEATURE_NAMES}


@pytest.mark.parametrize("settings", [
    {"seed": 7, "dupe_factor": 2},
    {"seed": 3, "whole_word_mask": True, "masked_lm_prob": 0.2, "short_seq_prob": 0.3},
    {"seed": 5, "next_sentence": False},
], ids=["pairs", "whole-words", "mlm-only"])
def test_text_files_and_prepared_shards_make_the_same_instances(corpus, tmp_path, settings):
    options = InstanceOptions(sequence_length=64, max_predictions_per_seq=10, **settings)
    shards = shards_road(corpus, tmp_path / "shards", options)
    text = load_or_create_instances(
        [str(f) for f in corpus], None, 64, 10, options.seed, cache_dir=tmp_path / "cache",
        dupe_factor=options.dupe_factor, masked_lm_prob=options.masked_lm_prob,
        short_seq_prob=options.short_seq_prob, whole_word_mask=options.whole_word_mask,
        next_sentence=options.next_sentence)
    assert len(text["input_ids"]) > 300
    for name in FEATURE_NAMES:
        assert text[name].dtype == shards[name].dtype, name
        assert np.array_equal(text[name], shards[name]), name
    if options.next_sentence:  # real data, not two empty agreements
        assert 0.3 < text["next_sentence_labels"].mean() < 0.7
        assert text["segment_ids"].any()
    assert (text["masked_lm_ids"] != 0).sum(axis=1).min() >= 1
    # Another seed is other data on either road.
    other = load_or_create_instances([str(f) for f in corpus], None, 64, 10, options.seed + 1,
                                     use_cache=False, next_sentence=options.next_sentence)
    assert not np.array_equal(other["input_ids"][:50], text["input_ids"][:50])


def test_the_cache_key_names_the_algorithm(corpus, tmp_path, monkeypatch):
    """A change of the instance algorithm is a new cache file, never a stale one read."""
    cache = tmp_path / "cache"
    load_or_create_instances([str(corpus[0])], None, 64, 10, 1, cache_dir=cache)
    assert len(list(cache.glob("*.h5"))) == 1
    monkeypatch.setattr(loader_mod, "INSTANCES_ALGORITHM_VERSION",
                        loader_mod.INSTANCES_ALGORITHM_VERSION + 1)
    load_or_create_instances([str(corpus[0])], None, 64, 10, 1, cache_dir=cache)
    assert len(list(cache.glob("*.h5"))) == 2


def tiny(corpus: list[Path], *overrides: str):
    return load_config("tiny", [f"data.input_files=['{corpus[0]}']",
                                "model.sequence_length=64", "model.max_predictions_per_seq=10",
                                *overrides])


def test_the_text_road_caches_in_data_cache_dir(corpus, tmp_path, monkeypatch):
    default = tmp_path / "default"
    monkeypatch.setenv("POPBERT_CACHE_DIR", str(default))
    chosen = tmp_path / "chosen"
    arrays = load_training_data(tiny(corpus, f"data.cache_dir={chosen}"))
    cached = list((chosen / "instances").glob("instances-s64-p10-*.h5"))
    assert len(cached) == 1 and not default.exists()
    assert read_shard(cached[0])["input_ids"].shape == arrays["input_ids"].shape
    load_training_data(tiny(corpus))  # unset: the default cache, as before
    assert len(list((default / "instances").glob("*.h5"))) == 1
    assert len(list((chosen / "instances").glob("*.h5"))) == 1


def test_an_unwritable_data_cache_dir_is_one_line_naming_it(corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"^data\.cache_dir: .*file/instances cannot be "
                                          r"written"):
        load_training_data(tiny(corpus, f"data.cache_dir={blocker}"))
