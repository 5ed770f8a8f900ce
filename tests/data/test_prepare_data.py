"""`popbert prepare-data` on a real (small) Wikipedia dump: every stage, the statistics of the
shards it writes, determinism, resumption, and one-line errors for unusable shards."""

from __future__ import annotations

import bz2
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from popbert.cli import main as cli
from popbert.cli.data import add_commands
from popbert.data import WordPieceTokenizer, read_shard, read_shard_info
from popbert.data.corpus import expand_input_files
from popbert.data.wikipedia import iter_pages, read_articles

FIXTURE = (Path(__file__).parent.parent / "fixtures" / "wiki"
           / "enwiki-fixture-pages-articles.xml.bz2")
VOCAB_SIZE = 2000
SEQ, PRED = 128, 20
PIPELINE = ["--vocab-size", str(VOCAB_SIZE), "--sequence-length", str(SEQ),
            "--max-predictions", str(PRED), "--dupe-factor", "2", "--seed", "7",
            "--part-size-mb", "0.04"]
# A tiny model for the runs that train on the shards (a couple of steps).
SMALL = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
         "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
         "--set", "execution.micro_batch_size=8", "--set", "training.log_every=1",
         "--set", "optimizer.warmup_steps=1"]


def with_prepare_data(build=cli.build_parser):
    """`popbert`'s parser with `prepare-data` added (unless cli.py already registers it)."""
    def build_parser():
        parser = build()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        if "prepare-data" not in sub.choices:
            parent = cli.argparse.ArgumentParser(add_help=False)
            parent.add_argument("--verbose", "-v", action="store_true",
                                default=cli.argparse.SUPPRESS)
            add_commands(sub, parent)
        return parser
    return build_parser


@pytest.fixture(autouse=True)
def prepare_data_cli(monkeypatch):
    monkeypatch.setattr(cli, "build_parser", with_prepare_data())


def popbert(*argv: str) -> int:
    return cli.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "wiki"
    mp = pytest.MonkeyPatch()
    mp.setattr(cli, "build_parser", with_prepare_data())
    try:
        assert popbert("prepare-data", "wikipedia", "--input", FIXTURE, "--output-dir", out,
                       "--workers", "2", *PIPELINE) == 0
    finally:
        mp.undo()
    return out


@pytest.fixture(scope="module")
def tokenizer(prepared) -> WordPieceTokenizer:
    return WordPieceTokenizer(prepared / "vocab.txt")


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.h5"))


def test_every_stage_is_complete_with_several_parts(prepared):
    for stage in ("extracted", "sentences", "instances-s128-p20", "packed-s128-p20"):
        record = json.loads((prepared / stage / "_SUCCESS.json").read_text())
        assert len(record["parts"]) >= 3, stage  # several work units: parallel for real
        assert all((prepared / stage / p).is_file() for p in record["parts"])
    extract = json.loads((prepared / "extracted" / "_SUCCESS.json").read_text())["stats"]
    # 23 pages in the fixture: 19 articles; 3 redirects and a Wikipedia: page are skipped.
    assert extract["pages"] == extract["articles"] == 19
    titles = [a["title"] for p in sorted((prepared / "extracted").glob("*.jsonl"))
              for a in read_articles(p)]
    assert "AccessibleComputing" not in titles and "Actrius" in titles


def test_extracted_text_is_clean_prose_from_the_dump(prepared):
    articles = {a["title"]: a["text"] for p in sorted((prepared / "extracted").glob("*.jsonl"))
                for a in read_articles(p)}
    actrius = articles["Actrius"]
    assert "The film has no male actors, with all roles played by females." in actrius
    for marker in ("[[", "]]", "{{", "}}", "<ref", "'''"):
        assert marker not in actrius
    raw = {p.title: p.text for p in iter_pages(FIXTURE)}
    assert "[[" in raw["Actrius"]  # the markup was there and was removed


def test_sentences_are_one_per_line_with_documents_separated(prepared):
    text = "".join(p.read_text(encoding="utf-8")
                   for p in sorted((prepared / "sentences").glob("*.txt")))
    documents = [d for d in text.split("\n\n") if d.strip()]
    assert len(documents) >= 15
    lines = [s for d in documents for s in d.splitlines()]
    assert "The film has no male actors, with all roles played by females." in lines
    assert "The film was produced in 1996." in lines
    assert all(line.strip() == line and line for line in lines)


def test_vocabulary_is_trained_specials_first(prepared, tokenizer):
    lines = (prepared / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert lines[5:] == sorted(lines[5:]) and len(set(lines)) == len(lines)
    assert tokenizer.vocab_size == VOCAB_SIZE


def shard_statistics(paths: list[Path], tokenizer: WordPieceTokenizer) -> dict:
    """Mask rate, 80/10/10 split, NSP balance and id range over unpacked shards."""
    files = expand_input_files([str(p) for p in paths])
    totals = {"instances": 0, "tokens": 0, "predictions": 0, "masked": 0, "kept": 0,
              "random": 0, "random_next": 0, "special_masked": 0, "max_id": 0}
    special = np.array(sorted(tokenizer.special_ids))
    for path in files:
        a = read_shard(path, vocab_size=tokenizer.vocab_size, packed=False)
        used = a["masked_lm_ids"] != 0
        rows, slots = np.nonzero(used)
        at = a["input_ids"][rows, a["masked_lm_positions"][rows, slots]]
        labels = a["masked_lm_ids"][rows, slots]
        totals["instances"] += len(a["input_ids"])
        totals["tokens"] += int(a["input_mask"].sum())
        totals["predictions"] += int(used.sum())
        totals["masked"] += int((at == tokenizer.mask_id).sum())
        totals["kept"] += int((at == labels).sum())
        totals["random"] += int(((at != tokenizer.mask_id) & (at != labels)).sum())
        totals["random_next"] += int(a["next_sentence_labels"].sum())
        totals["special_masked"] += int(np.isin(labels, special).sum())
        totals["max_id"] = max(totals["max_id"], int(a["input_ids"].max()),
                               int(a["masked_lm_ids"].max()))
    p = max(1, totals["predictions"])
    return {**totals, "mask_rate": totals["predictions"] / max(1, totals["tokens"]),
            "mask_fraction": totals["masked"] / p, "keep_fraction": totals["kept"] / p,
            "random_fraction": totals["random"] / p,
            "random_next_fraction": totals["random_next"] / max(1, totals["instances"])}


def test_shard_statistics(prepared, tokenizer):
    paths = shards(prepared / "instances-s128-p20")
    stats = shard_statistics(paths, tokenizer)
    assert stats["instances"] > 200
    assert abs(stats["mask_rate"] - 0.15) < 0.01
    assert abs(stats["mask_fraction"] - 0.8) < 0.03
    assert abs(stats["keep_fraction"] - 0.1) < 0.03
    assert abs(stats["random_fraction"] - 0.1) < 0.03
    # NSP pairs are Bernoulli(0.5) per instance; the vocabulary trained by the fixture can differ
    # between runs (data/vocab.py), so allow 4 standard deviations of the binomial fraction.
    assert abs(stats["random_next_fraction"] - 0.5) < 4 * (0.25 / stats["instances"]) ** 0.5
    assert stats["special_masked"] == 0
    assert stats["max_id"] < tokenizer.vocab_size
    for path in paths:
        info = read_shard_info(path)
        assert info.attrs["vocab_sha256"] == tokenizer.vocab_sha256
        assert info.attrs["vocab_size"] == VOCAB_SIZE and info.attrs["dupe_factor"] == 2
        assert info.attrs["run_seed"] == 7 and info.attrs["schema_version"] == 1
        a = read_shard(path)
        used = a["masked_lm_ids"] != 0
        rows, slots = np.nonzero(used)
        at = a["masked_lm_positions"][rows, slots]
        assert np.all(at > 0)  # never [CLS]
        original = a["input_ids"].copy()
        original[rows, at] = a["masked_lm_ids"][rows, slots]
        assert not np.isin(original[rows, at], [tokenizer.cls_id, tokenizer.sep_id]).any()


def squash(tokenizer: WordPieceTokenizer, ids) -> list[str]:
    tokens = [tokenizer.backend.id_to_token(int(i)) for i in ids]
    text = "".join(t[2:] if t.startswith("##") else t for t in tokens)
    return [p for p in text.split("[UNK]") if p]


def test_decoded_instances_are_sentences_of_the_source(prepared, tokenizer):
    corpus = "".join(p.read_text(encoding="utf-8")
                     for p in sorted((prepared / "extracted").glob("*.jsonl")))
    source = "".join(tokenizer.backend.normalizer.normalize_str(
        " ".join(json.loads(line)["text"] for line in corpus.splitlines())).split())
    checked = 0
    for path in shards(prepared / "instances-s128-p20")[:2]:
        a = read_shard(path)
        rows, slots = np.nonzero(a["masked_lm_ids"] != 0)
        ids = a["input_ids"].copy()
        ids[rows, a["masked_lm_positions"][rows, slots]] = a["masked_lm_ids"][rows, slots]
        for row in range(0, len(ids), 7):
            length = int(a["input_mask"][row].sum())
            tokens = ids[row, :length]
            seps = np.nonzero(tokens == tokenizer.sep_id)[0]
            assert tokens[0] == tokenizer.cls_id and len(seps) == 2 and seps[1] == length - 1
            for segment in (tokens[1:seps[0]], tokens[seps[0] + 1:seps[1]]):
                for piece in squash(tokenizer, segment):
                    assert piece in source, piece[:80]
                    checked += 1
    assert checked > 50


def test_same_result_with_one_worker_and_idempotent_rerun(prepared, tmp_path):
    # HF's WordPiece trainer breaks ties between equally frequent merges differently from run
    # to run, so the vocabulary is given; everything else must be identical.
    single = tmp_path / "single"
    vocab = tmp_path / "vocab.txt"
    shutil.copy(prepared / "vocab.txt", vocab)
    argv = ["prepare-data", "wikipedia", "--input", FIXTURE, "--output-dir", single,
            "--workers", "1", "--vocab", vocab, *PIPELINE]
    assert popbert(*argv) == 0
    for stage in ("extracted", "sentences"):
        for a, b in zip(sorted((prepared / stage).glob("part-*")),
                        sorted((single / stage).glob("part-*")), strict=True):
            assert a.read_bytes() == b.read_bytes()
    for stage in ("instances-s128-p20", "packed-s128-p20"):
        for a, b in zip(shards(prepared / stage), shards(single / stage), strict=True):
            x, y = read_shard(a), read_shard(b)
            assert all(np.array_equal(x[k], y[k]) for k in x)

    # Interrupted run: one shard missing, a stale temporary file, no completion marker.
    victim = shards(single / "instances-s128-p20")[1]
    expected = read_shard(victim)
    victim.unlink()
    (single / "instances-s128-p20" / "_SUCCESS.json").unlink()
    (single / "instances-s128-p20" / ".part-00001.h5.tmp-999").write_bytes(b"half")
    (single / "packed-s128-p20" / "_SUCCESS.json").unlink()
    others = {p: p.stat().st_mtime_ns for p in shards(single / "instances-s128-p20")}
    assert popbert(*argv) == 0
    remade = read_shard(victim)
    assert all(np.array_equal(expected[k], remade[k]) for k in expected)
    assert {p: p.stat().st_mtime_ns for p in others} == others  # finished parts untouched


def test_different_parameters_in_the_same_directory_is_a_one_line_error(prepared, capsys):
    assert popbert("prepare-data", "wikipedia", "--input", FIXTURE, "--output-dir", prepared,
                   *PIPELINE[:-4], "--seed", "8", "--part-size-mb", "0.04") == 2
    err = capsys.readouterr().err.strip().splitlines()
    # INFO progress lines may precede it; the error itself is one line, with no traceback.
    errors = [line for line in err if line.startswith("popbert: error:")]
    assert not [line for line in err if "Traceback" in line]
    assert len(errors) == 1 and "instances-s128-p20" in errors[0] and "seed" in errors[0]


def test_stage_commands_one_by_one_and_given_vocab(prepared, tmp_path, capsys):
    out = tmp_path / "stages"
    assert popbert("prepare-data", "extract", "--input", FIXTURE, "--output-dir",
                   out / "extracted", "--part-size-mb", "0.04", "-j", "1") == 0
    assert popbert("prepare-data", "sentences", "--input", out / "extracted", "--output-dir",
                   out / "sentences", "-j", "1") == 0
    assert popbert("prepare-data", "vocab", "--input", out / "sentences", "--output",
                   out / "vocab.txt", "--vocab-size", VOCAB_SIZE) == 0
    trained = (out / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert len(trained) == VOCAB_SIZE and trained[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                          "[MASK]"]
    assert popbert("prepare-data", "instances", "--input", out / "sentences", "--vocab",
                   prepared / "vocab.txt", "--output-dir", out / "inst", "--sequence-length",
                   64, "--max-predictions", 10, "--whole-word-mask", "-j", "1") == 0
    assert popbert("prepare-data", "pack", "--input", out / "inst", "--output-dir",
                   out / "packed", "--strategy", "lpfhp", "-j", "1") == 0
    info = read_shard_info(shards(out / "packed")[0])
    assert info.packed and info.sequence_length == 64 and info.max_sequences_per_pack == 3
    assert info.attrs["packing_strategy"] == "lpfhp" and info.attrs["whole_word_mask"] == 1
    record = json.loads((out / "packed" / "_SUCCESS.json").read_text())["stats"]
    assert record["padding_after"] < record["padding_before"]


@pytest.mark.parametrize("argv, fragment", [
    (["extract", "--input", "missing.xml.bz2", "--output-dir", "{tmp}/x"], "missing.xml.bz2"),
    (["instances", "--input", "{tmp}", "--vocab", "v.txt", "--output-dir", "{tmp}/i",
      "--sequence-length", "128", "--max-predictions", "20"], "--vocab"),
    (["instances", "--input", "{tmp}", "--vocab", "{vocab}", "--output-dir", "{tmp}/i",
      "--sequence-length", "128", "--max-predictions", "200"], "--max-predictions"),
    (["sentences", "--input", "{tmp}", "--output-dir", "{tmp}/s"], "part-*.jsonl"),
    (["pack", "--input", "{tmp}/*.h5", "--output-dir", "{tmp}/p"], "--input"),
    (["wikipedia", "--input", "{fixture}", "--output-dir", "{tmp}/w", "--sequence-length",
      "128", "--max-predictions", "20", "--workers", "0"], "--workers"),
    (["wikipedia", "--input", "{fixture}", "--output-dir", "{tmp}/w", "--sequence-length",
      "128", "--max-predictions", "20", "--workers", "100000"],
     "--workers must be from 1 to 1024, got 100000"),
    (["wikipedia", "--input", "{fixture}", "--output-dir", "{tmp}/w", "--sequence-length",
      "128", "--max-predictions", "20", "--seed", "-1"], "--seed must be from 0 to"),
    (["pack", "--input", "{prepared}/instances-s128-p20", "--output-dir", "{tmp}/p", "--seed",
      str(2**70)], "--seed must be from 0 to 2147483647"),
])
def test_bad_arguments_are_one_line_errors(argv, fragment, tmp_path, capsys, prepared):
    values = {"tmp": tmp_path, "vocab": prepared / "vocab.txt", "fixture": FIXTURE,
              "prepared": prepared}
    assert popbert("prepare-data", *[a.format(**values) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("popbert: error:") and fragment in err[0], err


def test_not_a_dump_is_a_one_line_error(tmp_path, capsys):
    bogus = tmp_path / "dump.xml.bz2"
    bogus.write_bytes(bz2.compress(b"<html><body>not a dump</body></html>"))
    assert popbert("prepare-data", "extract", "--input", bogus, "--output-dir",
                   tmp_path / "x") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dump.xml.bz2" in err[0] and "MediaWiki" in err[0]


def fake_dump(path: Path, pages: list[tuple[int, str, str, bool]]) -> Path:
    """A bz2 MediaWiki export of (namespace, title, wikitext, is_redirect) pages."""
    redirect_tag = '<redirect title="X" />'
    body = "".join(
        f"<page><title>{title}</title><ns>{ns}</ns><id>{i + 1}</id>"
        f"{redirect_tag if redirect else ''}"
        f"<revision><id>{i + 10}</id><timestamp>2020-01-01T00:00:00Z</timestamp>"
        f"<text>{text}</text></revision></page>"
        for i, (ns, title, text, redirect) in enumerate(pages))
    path.write_bytes(bz2.compress(
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><siteinfo><sitename>'
        f"Wikipedia</sitename></siteinfo>{body}</mediawiki>".encode()))
    return path


PROSE = ("The river rises in the northern hills and flows south for many kilometres. "
         "It passes three towns before it reaches the sea.")


@pytest.mark.parametrize("pages, fragment", [
    ([], "no articles"),
    ([(1, "Talk:River", PROSE, False), (0, "Stream", "#REDIRECT [[River]]", True)],
     "no articles"),
    ([(0, "Stub", "{{stub}}", False)], "none of its 1 article pages has text left"),
])
@pytest.mark.parametrize("command", ["extract", "wikipedia"])
def test_a_dump_without_articles_is_a_one_line_error_leaving_nothing(command, pages, fragment,
                                                                     tmp_path, capsys):
    dump = fake_dump(tmp_path / "enwiki-empty.xml.bz2", pages)
    out = tmp_path / "out" / "wiki"
    argv = ["prepare-data", command, "--input", dump, "--output-dir", out, "-j", "1"]
    if command == "wikipedia":
        argv += ["--sequence-length", "64", "--max-predictions", "10"]
    assert popbert(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("popbert: error:")]
    assert len(errors) == 1 and str(dump) in errors[0] and fragment in errors[0], err
    assert not [line for line in err if "Traceback" in line]
    # No completion marker, no half-written stage: the output directory was never there.
    assert not (tmp_path / "out").exists()


def test_an_existing_output_directory_is_kept_but_never_marked_complete(tmp_path, capsys):
    dump = fake_dump(tmp_path / "enwiki-empty.xml.bz2", [])
    out = tmp_path / "extracted"
    (out / "notes").mkdir(parents=True)
    assert popbert("prepare-data", "extract", "--input", dump, "--output-dir", out) == 2
    assert "no articles" in capsys.readouterr().err
    assert (out / "notes").is_dir() and not list(out.glob("_SUCCESS*"))


@pytest.mark.parametrize("stage", ["sentences", "short", "instances", "vocab"])
def test_an_empty_corpus_stops_the_stage_naming_the_file(stage, tmp_path, capsys, prepared):
    """Each stage that reads text refuses an input without any, naming it, instead of writing
    a finished stage over nothing for the next stage to trip on."""
    out = tmp_path / "stage"
    if stage in ("sentences", "short"):
        source = tmp_path / "part-00000.jsonl"
        text = "" if stage == "sentences" else json.dumps(
            {"id": "1", "title": "Short", "text": "Only one sentence here."}) + "\n"
        source.write_text(text, encoding="utf-8")
        argv = ["sentences", "--input", source, "--output-dir", out, "-j", "1"]
        fragment = ("is an empty file" if stage == "sentences"  # refused by --input's check
                    else "all 1 articles have fewer than 2 sentences")
    else:
        source = tmp_path / "empty.txt"
        source.write_text("\n\n", encoding="utf-8")
        fragment = "empty corpus"
        if stage == "instances":
            argv = ["instances", "--input", source, "--vocab", prepared / "vocab.txt",
                    "--output-dir", out, "--sequence-length", "64", "--max-predictions", "10",
                    "-j", "1"]
        else:
            argv = ["vocab", "--input", source, "--output", out / "vocab.txt"]
    assert popbert("prepare-data", *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("popbert: error:")]
    assert len(errors) == 1 and f"{source}: " in errors[0], err
    assert fragment in errors[0], errors[0]
    assert not out.exists()


def test_pretraining_on_an_empty_text_file_is_a_one_line_error_naming_it(tmp_path, capsys):
    empty = tmp_path / "corpus.txt"
    for text, said in (("", f"data.input_files {empty}: is an empty file"),  # the key's check
                       ("\n\n", f"{empty}: empty corpus")):  # no text: the reader's
        empty.write_text(text, encoding="utf-8")
        assert popbert("pretrain", *SMALL, "--set", f"data.input_files=['{empty}']",
                       "--output-dir", tmp_path / "run") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not (tmp_path / "run").exists()


def train_args(tmp_path: Path, shard_glob: str, vocab: Path, *extra: str) -> list[str]:
    return ["pretrain", *SMALL, "--set", f"data.input_files=['{shard_glob}']",
            "--set", f"data.vocab_file={vocab}", "--set", f"model.vocab_size={VOCAB_SIZE}",
            "--output-dir", str(tmp_path / "run"), *extra]


@pytest.mark.e2e
def test_pipeline_shards_train_through_the_main_job(prepared, tmp_path):
    shard_glob = str(prepared / "instances-s128-p20" / "part-*.h5")
    assert popbert(*train_args(tmp_path, shard_glob, prepared / "vocab.txt",
                               "--set", "training.steps=3")) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics and all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)


@pytest.mark.parametrize("case", ["sequence", "truncated", "not_hdf5", "packed", "vocab"])
def test_unusable_shards_are_one_line_errors_naming_the_file(case, prepared, tmp_path, capsys):
    src = shards(prepared / "instances-s128-p20")[0]
    bad = tmp_path / "bad" / "part-00000.h5"
    bad.parent.mkdir()
    extra: list[str] = []
    expect = [str(bad)]
    if case == "sequence":
        shutil.copy(src, bad)
        extra = ["--set", "model.sequence_length=64"]
        expect.append("sequence length 128, run expects 64")
    elif case == "truncated":
        data = src.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif case == "not_hdf5":
        bad.write_text("input_ids,input_mask\n1,2\n")
        expect.append("not a readable HDF5 file")
    elif case == "packed":
        shutil.copy(src, bad)
        extra = ["--set", "model.packed=true"]
        expect.append("not a packed shard")
    else:
        shutil.copy(src, bad)
        with h5py.File(bad, "a") as f:
            f.attrs["vocab_sha256"] = "0" * 64
        expect.append("vocabulary sha256")
    argv = train_args(tmp_path, str(bad.parent / "*.h5"), prepared / "vocab.txt", *extra)
    assert popbert(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("popbert: error:"), err
    assert all(e in err[0] for e in expect), err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_nvidia_layout_shard_written_with_plain_h5py_loads_and_trains(prepared, tmp_path):
    """NVIDIA's shards: the six datasets, no attributes, NSP labels as [N, 1] int64."""
    a = read_shard(shards(prepared / "instances-s128-p20")[0])
    path = tmp_path / "nvidia" / "wikicorpus_en_training_0.hdf5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        for name in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                     "masked_lm_ids"):
            f.create_dataset(name, data=a[name].astype(np.int64), compression="gzip")
        f.create_dataset("next_sentence_labels",
                         data=a["next_sentence_labels"].reshape(-1, 1).astype(np.int64))
    info = read_shard_info(path)
    assert info.schema_version is None and not info.packed
    assert popbert(*train_args(tmp_path, str(path.parent / "*.hdf5"), prepared / "vocab.txt",
                               "--set", "training.steps=2")) == 0
    assert (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.parametrize("whole_word", [False, True])
def test_vectorised_masking_follows_googles_rule(whole_word):
    """`create_instance_arrays` (the pipeline's) masks like `InstanceCreator` does: the same
    budget per row, never a special token, whole words with whole-word masking, and the same
    statistics as the per-instance Python version."""
    from popbert.data import (
        InstanceOptions,
        bundled_corpus_path,
        create_instance_arrays,
        read_documents,
    )
    from popbert.data.instances import reference_instance_arrays

    tok = WordPieceTokenizer()
    documents = read_documents(bundled_corpus_path(), tok)[:600]
    options = InstanceOptions(128, 20, seed=11, dupe_factor=2, whole_word_mask=whole_word)
    a = create_instance_arrays(documents, tok, options)
    again = create_instance_arrays(documents, tok, options)
    assert all(np.array_equal(a[k], again[k]) for k in a)  # deterministic for a seed
    lengths = a["input_mask"].sum(axis=1)
    used = a["masked_lm_ids"] != 0
    budget = np.minimum(20, np.maximum(1, np.round(lengths * 0.15)))
    assert np.all(used.sum(axis=1) <= budget)
    if not whole_word:
        assert np.all(used.sum(axis=1) == budget)
    else:
        assert np.mean(used.sum(axis=1) == budget) > 0.95  # a long last word may not fit
    rows, slots = np.nonzero(used)
    positions = a["masked_lm_positions"][rows, slots]
    original = a["input_ids"].copy()
    original[rows, positions] = a["masked_lm_ids"][rows, slots]
    assert not np.isin(a["masked_lm_ids"][rows, slots], sorted(tok.special_ids)).any()
    chosen = np.zeros_like(used, shape=a["input_ids"].shape)
    chosen[rows, positions] = True
    if whole_word:
        # A "##" piece is chosen exactly when the token before it is (unless that is [CLS] or
        # [SEP]: truncation can leave a segment starting with a "##" piece).
        previous = np.zeros_like(original)
        previous[:, 1:] = original[:, :-1]
        cont = (tok.is_continuation[original] & (np.arange(128)[None, :] > 0)
                & (np.arange(128)[None, :] < lengths[:, None])
                & ~np.isin(previous, [tok.cls_id, tok.sep_id]))
        r, c = np.nonzero(cont)
        assert len(r) > 1000
        assert np.array_equal(chosen[r, c], chosen[r, c - 1])
    reference = reference_instance_arrays(documents, tok, options)  # Google's Python masking
    ref_used = reference["masked_lm_ids"] != 0
    assert abs(used.sum() / lengths.sum()
               - ref_used.sum() / reference["input_mask"].sum()) < 0.003
    at = a["input_ids"][rows, positions]
    assert abs(np.mean(at == tok.mask_id) - 0.8) < 0.02
