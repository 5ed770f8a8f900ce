"""Time to quality: wall-clock seconds to a validation MLM loss, and the downstream accuracy of
the model that comes out, for popbert's `fast` preset (a ModernBERT) and `groupbert-fast` (the
GroupBERT recipe that was `fast` before it) against the recipe users run today.

Up to four runs with the same training-time budget, on the same real text (`benchmarks/data`:
6,736 Wikipedia article leads for training, 400 held out), measured on the same held-out rows
(fixed 15% masks, 128 tokens) at the same fractions of the budget:

- **peer**: Hugging Face `transformers` the way its users pre-train a small BERT: a
  `BertForMaskedLM` (BERT-Mini shape, L4 H256, dropout 0.1, SDPA attention) given popbert's
  masked-positions head (the fair version: it does not project every token onto the
  vocabulary), `torch.optim.AdamW` with linear warmup and decay laid over the budget, gradient
  clipping 1.0, BF16 autocast. Its learning rate is the best of a small sweep (`--peer-lrs`),
  each at the full budget. It reads exactly popbert's batches (MLM-only rows of contiguous
  text, masked anew every batch, as `DataCollatorForLanguageModeling` does).
- **popbert-same**: popbert with the peer's recipe (model, optimizer, schedule, data, BF16): the
  control, which should be about 1.0x.
- **popbert-fast**: `popbert pretrain --config fast` with the budget and the text files, as a
  user runs it (ModernBERT), plus `--fast-set`.
- **popbert-groupbert-fast**: `popbert pretrain --config groupbert-fast` the same way (the same
  bundled WordPiece vocabulary, so its validation loss is comparable), plus `--groupbert-set`.

Then every final model is fine-tuned the same way (`popbert finetune classification`: the topic
of 1,600 held-out articles, scored on 800 others) and its accuracy reported with its standard
error. The time-to-quality ratio: the seconds the peer trained to reach its final validation
loss divided by the seconds a run needed to reach that loss (linear between evaluations). With
`popbert-groupbert-fast` in the runs, each run's seconds to its final loss too (ModernBERT's
goal: at most 3/4 of GroupBERT's). Training FLOPs per optimizer step come from `popbert plan` (its
training FLOPs per sequence, x the global batch; the peer is counted as popbert-same, the same
model), and the validation loss of each run at equal training FLOPs: at the smallest total that
`fast` and `groupbert-fast` reached in the budget (linear between evaluations).

    python benchmarks/time_to_quality.py                         # 7-minute budgets, ~55 min
    python benchmarks/time_to_quality.py --budget 120 --peer-lrs 1e-3   # a quick look
    python benchmarks/time_to_quality.py --peer-lrs 1e-3         # one peer lr: ~42 min
    python benchmarks/time_to_quality.py --peer-lrs 1e-3 --runs peer popbert-fast
    python benchmarks/time_to_quality.py --budget 1800 --peer-lrs 1e-3 --runs peer popbert-fast

`--runs` picks the runs (default all; a run already in `--work-dir` is not run again, so the
same directory adds rows to earlier ones); without `peer`, popbert-same takes the one
`--peer-lrs` and there is no peer target. Writes `<work-dir>/results.json`,
`<work-dir>/time_to_quality.png` (validation loss against training seconds and against
training FLOPs) and prints Markdown tables. Each run is its own process (the CLI for popbert,
this file's `peer` subcommand for the peer), one after another, all with the same threads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"
SEQ, PREDICTIONS = 128, 20
RUNS = ("peer", "popbert-same", "popbert-fast", "popbert-groupbert-fast")
REFERENCE = "popbert-groupbert-fast"  # the run whose final loss the others are timed to
TOPIC_TEST_ROWS = 800

# The peer's model and recipe, and popbert-same's overrides that make the same run.
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024}
PEER_RECIPE = {"dropout": 0.1, "micro_batch_size": 32, "warmup_fraction": 0.06,
               "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-6, "max_grad_norm": 1.0}


def same_recipe_overrides(lr: float) -> list[str]:
    """`--set` overrides that make popbert run the peer's recipe (from the tiny preset)."""
    r = PEER_RECIPE
    values = {
        **{f"model.{k}": v for k, v in SHAPE.items()},
        "model.max_position_embeddings": SEQ, "model.sequence_length": SEQ,
        "model.max_predictions_per_seq": PREDICTIONS, "model.next_sentence_prediction": "false",
        "model.hidden_dropout": r["dropout"], "model.attention_dropout": r["dropout"],
        "data.dynamic_masking": "true", "data.masked_lm_prob": 0.15,
        "optimizer.name": "adamw", "optimizer.lr": lr, "optimizer.betas": list(r["betas"]),
        "optimizer.eps": r["eps"], "optimizer.weight_decay": r["weight_decay"],
        "optimizer.bias_correction": "true", "optimizer.max_grad_norm": r["max_grad_norm"],
        "optimizer.warmup_steps": round(1000 * r["warmup_fraction"]),
        "optimizer.warmup_start_lr": 0.0, "optimizer.decay": "linear", "optimizer.end_lr": 0.0,
        "execution.micro_batch_size": r["micro_batch_size"],
        "execution.compute_dtype": "bfloat16", "training.steps": 1000,
    }
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in values.items()]


# ------------------------------------------------------------------------------ data
def prepare(work: Path, predictions: int = PREDICTIONS) -> dict[str, Path]:
    """The text files, decompressed, and the held-out rows every run is measured on (with
    `predictions` slots per row for a model that has that many; the masks are the same)."""
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in ("train", "heldout"):
        target = work / f"{name}.txt"
        if not target.is_file():
            with gzip.open(DATA / f"wiki-vital-{name}.txt.gz", "rb") as src, \
                    open(target, "wb") as out:
                shutil.copyfileobj(src, out)
        files[name] = target
    files["validation"] = work / f"validation-p{predictions}.h5"
    if not files["validation"].is_file():
        from popbert.data import InstanceOptions, WordPieceTokenizer, read_documents
        from popbert.data.hdf5 import write_shard
        from popbert.data.instances import create_chunk_arrays

        tokenizer = WordPieceTokenizer()
        options = InstanceOptions(sequence_length=SEQ, max_predictions_per_seq=predictions,
                                  masked_lm_prob=0.15, seed=2024, next_sentence=False)
        arrays = create_chunk_arrays(read_documents([files["heldout"]], tokenizer), tokenizer,
                                     options)
        write_shard(files["validation"], arrays, vocab_size=tokenizer.vocab_size,
                    vocab_sha256=tokenizer.vocab_sha256, options=options)
    return files


def validation_rows(files: dict[str, Path]) -> int:
    from popbert.data.hdf5 import read_shard_info

    return read_shard_info(files["validation"]).num_samples


# ------------------------------------------------------------------------------ the peer
def peer_main(args: argparse.Namespace) -> None:
    """One peer run (its own process): train under the budget, evaluate at its fractions,
    write metrics.jsonl (the same fields as popbert's) and the model for fine-tuning."""
    import numpy as np
    import torch
    import transformers

    import popbert
    from popbert.data.pretraining import load_training_data, make_loader

    torch.manual_seed(42)
    r = PEER_RECIPE
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # popbert's config for the same recipe gives the peer exactly popbert-same's batches.
    cfg = popbert.load_config("tiny", same_recipe_overrides(args.lr) + [
        f"data.input_files=[{args.train}]", "tracking.run_name=peer"])
    loader = make_loader(cfg, load_training_data(cfg))
    from popbert.data import PretrainingLoader

    validation = PretrainingLoader(str(args.validation), r["micro_batch_size"], seed=0,
                                   shuffle=False, drop_last=False, prefetch_shards=0)
    eval_batches = [next(validation) for _ in range(args.eval_batches)]

    hf_config = transformers.BertConfig(
        vocab_size=cfg.model.vocab_size, hidden_size=SHAPE["hidden_size"],
        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
        intermediate_size=SHAPE["intermediate_size"], max_position_embeddings=SEQ,
        hidden_dropout_prob=r["dropout"], attention_probs_dropout_prob=r["dropout"],
        attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(hf_config)
    # transformers.Trainer's grouping: no weight decay on biases and LayerNorm weights.
    exempt = {n for n, _ in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n}
    decay = [p for n, p in model.named_parameters() if n not in exempt]
    no_decay = [p for n, p in model.named_parameters() if n in exempt]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": r["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=r["betas"], eps=r["eps"])
    step_fn = torch.compile(masked_lm_loss) if args.compile else masked_lm_loss

    def lr_at(progress: float) -> float:  # linear warmup then linear decay, over the budget
        w = r["warmup_fraction"]
        return args.lr * (progress / w if progress < w else max(0.0, (1 - progress) / (1 - w)))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [float(masked_lm_loss(model, b)) for b in eval_batches]
        model.train()
        return float(np.mean(losses))

    records = []
    elapsed, step, next_point = 0.0, 0, 1 / args.eval_points
    longest = 0.0
    model.train()
    with open(out / "metrics.jsonl", "w") as log:
        while elapsed + longest < args.budget:
            started = time.perf_counter()
            progress = elapsed / args.budget
            for group in optimizer.param_groups:
                group["lr"] = lr_at(progress)
            batch = next(loader)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step_fn(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), r["max_grad_norm"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            took = time.perf_counter() - started
            elapsed += took
            longest = max(longest, took) if step > 3 else longest  # the first steps warm up
            if elapsed / args.budget >= next_point or elapsed + longest >= args.budget:
                next_point = (math.floor(elapsed / args.budget * args.eval_points) + 1) \
                    / args.eval_points
                record = {"step": step, "loss": float(loss.detach()),
                          "elapsed_s": round(elapsed, 3),
                          "val_mlm_loss": evaluate()}
                records.append(record)
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(f"peer lr {args.lr:g}: step {step}, {elapsed:.0f} s, "
                      f"val {record['val_mlm_loss']:.3f}", flush=True)
    model.save_pretrained(out / "hf")
    shutil.copy(ROOT / "data" / "resources" / "vocab.txt", out / "hf" / "vocab.txt")


def masked_lm_loss(model, batch):
    """popbert's head on `BertForMaskedLM`: the encoder, the masked positions gathered, the
    prediction head on those only, cross-entropy over the real slots (label 0 is padding)."""
    import torch
    import torch.nn.functional as F

    hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                        token_type_ids=batch["segment_ids"]).last_hidden_state
    positions = batch["masked_lm_positions"]
    gathered = torch.gather(hidden, 1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.cls(gathered)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           batch["masked_lm_ids"].reshape(-1), ignore_index=0)


# ------------------------------------------------------------------------------ runs
def run(command: list[str], log: Path) -> None:
    print("$", " ".join(str(c) for c in command), flush=True)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): see {log}")


COMMANDS: dict[str, str] = {}  # each run's command line, for the results


def popbert_run(name: str, config: str, overrides: list[str], files: dict[str, Path],
                work: Path, budget: float, eval_points: int, eval_batches: int) -> Path:
    out = work / name
    sets = overrides + [f"training.time_budget={budget}",
                        f"data.input_files=[{files['train']}]",
                        f"data.validation_files=[{files['validation']}]",
                        f"training.eval_points={eval_points}",
                        f"training.eval_batches={eval_batches}",
                        # every point on every batch, as the peer is measured (not a quarter)
                        "training.eval_share=10", f"tracking.run_name={name}"]
    command = [sys.executable, "-m", "popbert", "pretrain", "--config", config, "-o", str(out)]
    for item in sets:
        command += ["--set", item]
    line = " ".join(command[1:])
    COMMANDS[name] = line
    recorded = work / f"{name}.command"
    if (out / "metrics.jsonl").is_file() and any(out.glob("checkpoints/step-*")) \
            and (not recorded.is_file() or recorded.read_text() == line):
        return out  # done in an earlier invocation (by the same command, where recorded)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / f"{name}-topic", ignore_errors=True)  # its fine-tuning is stale too
    work.mkdir(parents=True, exist_ok=True)
    recorded.write_text(line)
    run(command, work / f"{name}.log")
    return out


def peer_run(lr: float, files: dict[str, Path], work: Path, budget: float, eval_points: int,
             eval_batches: int, compile_: bool) -> Path:
    out = work / f"peer-lr{lr:g}"
    if (out / "hf" / "config.json").is_file():
        return out
    command = [sys.executable, __file__, "peer", "--lr", str(lr), "--budget", str(budget),
               "--train", str(files["train"]), "--validation", str(files["validation"]),
               "--eval-points", str(eval_points), "--eval-batches", str(eval_batches),
               "--output-dir", str(out)] + (["--compile"] if compile_ else [])
    COMMANDS[f"peer-lr{lr:g}"] = " ".join(command[1:])
    run(command, work / f"peer-lr{lr:g}.log")
    return out


def curve(run_dir: Path) -> list[tuple[float, float]]:
    """(training seconds, validation MLM loss) of every evaluation in a run's metrics.jsonl."""
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val_mlm_loss" in record:
            points.append((record["elapsed_s"], record["val_mlm_loss"]))
    return points


def seconds_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time the curve reaches `target` (linear between evaluations; None: never)."""
    previous = (0.0, math.inf)
    for t, loss in points:
        if loss <= target:
            if not math.isfinite(previous[1]):
                return t
            (t0, l0) = previous
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        previous = (t, loss)
    return None


def steps_curve(run_dir: Path) -> tuple[int, list[int]]:
    """The run's last optimizer step and the step of each evaluation (as in `curve`)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (max(r["step"] for r in records),
            [r["step"] for r in records if "val_mlm_loss" in r])


def value_at(points: list[tuple[float, float]], x: float) -> float | None:
    """The curve's value at `x` (linear between points; None outside them)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and math.isclose(x, points[0][0], rel_tol=1e-9):
        return points[0][1]
    return None


def training_flops_per_step(config: str, overrides: list[str]) -> int:
    """`popbert plan`'s training FLOPs per sequence (3 x the forward matmuls, attention
    included) x the global batch: the FLOPs of one optimizer step of the run."""
    import popbert
    from popbert.plan.estimate import plan_run

    cfg = popbert.load_config(config, overrides)
    e = cfg.execution
    per_sequence = plan_run(cfg).totals.training_flops_per_sequence
    return per_sequence * e.micro_batch_size * e.gradient_accumulation * e.replicas


def downstream(name: str, checkpoint: Path, work: Path, args: argparse.Namespace) -> float:
    """Fine-tune on the topic task the same way for every model; the held-out accuracy."""
    out = work / f"{name}-topic"
    scores = out / "eval_results.json"
    if not scores.is_file():
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", "popbert", "finetune", "classify",
                   "--checkpoint", str(checkpoint), "--train", str(DATA / "topic-train.jsonl"),
                   "--eval", str(DATA / "topic-test.jsonl"), "-o", str(out),
                   "--epochs", str(args.finetune_epochs), "--lr", str(args.finetune_lr),
                   "--seed", "1", "--dropout", "0.1"]
        run(command, work / f"{name}-topic.log")
    return float(json.loads(scores.read_text())["accuracy"])


def import_peer(peer_dir: Path, work: Path) -> Path:
    target = work / f"{peer_dir.name}-popbert"
    if not (target / "config.yaml").is_file():
        shutil.rmtree(target, ignore_errors=True)
        run([sys.executable, "-m", "popbert", "import-hf", "--model", str(peer_dir / "hf"),
             "--output-dir", str(target)], work / "peer-import.log")
    return target


def main(args: argparse.Namespace) -> None:
    import popbert

    work = Path(args.work_dir)
    files = prepare(work)
    eval_batches = math.ceil(validation_rows(files) / PEER_RECIPE["micro_batch_size"])
    started, started_utc = time.time(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    selected = [name for name in RUNS if name in args.runs]
    runs: dict[str, Path] = {}
    # name -> (config, overrides) of the popbert runs: their FLOPs come from `popbert plan`
    configs: dict[str, tuple[str, list[str]]] = {}
    finals: dict[float, float] = {}
    if "peer" in selected:
        peers = {lr: peer_run(lr, files, work, args.budget, args.eval_points, eval_batches,
                              args.peer_compile) for lr in args.peer_lrs}
        finals = {lr: curve(d)[-1][1] for lr, d in peers.items()}
        best_lr = min(finals, key=finals.get)
        runs["peer"] = peers[best_lr]
    elif len(args.peer_lrs) == 1:
        best_lr = args.peer_lrs[0]
    else:
        best_lr = None
        if "popbert-same" in selected:
            sys.exit("popbert-same without the peer: give its learning rate as one --peer-lrs")
    if best_lr is not None:
        configs["peer"] = configs["popbert-same"] = ("tiny", same_recipe_overrides(best_lr))
    if "popbert-same" in selected:
        runs["popbert-same"] = popbert_run("popbert-same", "tiny", same_recipe_overrides(best_lr),
                                           files, work, args.budget, args.eval_points,
                                           eval_batches)
    for name, config, overrides in (("popbert-fast", "fast", args.fast_set),
                                    ("popbert-groupbert-fast", "groupbert-fast",
                                     args.groupbert_set)):
        configs[name] = (config, overrides)
        if name in selected:
            predictions = popbert.load_config(config, overrides).model.max_predictions_per_seq
            runs[name] = popbert_run(name, config, overrides, prepare(work, predictions), work,
                                     args.budget, args.eval_points, eval_batches)
    ended_training_utc = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_after_training = os.getloadavg()
    curves = {name: curve(d) for name, d in runs.items()}
    target = curves["peer"][-1][1] if "peer" in curves else None
    peer_seconds = seconds_to_reach(curves["peer"], target) if target is not None else None
    reference_final = curves[REFERENCE][-1][1] if REFERENCE in curves else None
    reference_seconds = seconds_to_reach(curves[REFERENCE], reference_final) \
        if reference_final is not None else None
    results = {"budget_s": args.budget, "peer_lrs": {str(k): v for k, v in finals.items()},
               "peer_best_lr": best_lr, "target_val_mlm_loss": target,
               "reference_run": REFERENCE, "reference_final_val_mlm_loss": reference_final,
               "reference_seconds_to_final": reference_seconds,
               "load_at_start": load[0], "loadavg_at_start": load,
               "loadavg_after_training": load_after_training,
               "date": started_utc, "started_utc": started_utc,
               "ended_training_utc": ended_training_utc, "threads": os.cpu_count(),
               "cpu": _cpu_name(), "versions": _versions(),
               "validation_rows": validation_rows(files), "commands": {}, "runs": {}}
    for name, points in curves.items():
        steps, eval_steps = steps_curve(runs[name])
        entry = {"final_val_mlm_loss": points[-1][1], "steps": steps,
                 "s_per_step": points[-1][0] / steps, "curve": points}
        if target is not None:
            reach = seconds_to_reach(points, target)
            entry.update(seconds_to_target=reach,
                         ratio=peer_seconds / reach if reach else None)
        if reference_final is not None:
            reach = seconds_to_reach(points, reference_final)
            entry.update(seconds_to_reference_final=reach,
                         reference_time_ratio=reference_seconds / reach if reach else None)
        if name in configs:
            per_step = training_flops_per_step(*configs[name])
            entry.update(training_flops_per_step=per_step, training_flops=steps * per_step,
                         training_flops_per_s=steps * per_step / points[-1][0],
                         flops_curve=[(s * per_step, loss)
                                      for s, (_, loss) in zip(eval_steps, points)])
        results["runs"][name] = entry
    results["commands"] = {n: c for n, c in COMMANDS.items()
                           if n in runs or n.startswith("peer-lr")}
    compared = [n for n in ("popbert-fast", REFERENCE)
                if "flops_curve" in results["runs"].get(n, {})]
    if compared:  # equal training FLOPs: the smallest total either of the two reached
        by = min(compared, key=lambda n: results["runs"][n]["training_flops"])
        flops = results["runs"][by]["training_flops"]
        results["equal_flops"] = {
            "training_flops": flops, "set_by": by, "compared": compared,
            "val_mlm_loss": {n: value_at(r["flops_curve"], flops)
                             for n, r in results["runs"].items() if "flops_curve" in r},
            "seconds": {n: value_at([(f, t) for (f, _), (t, _) in
                                     zip(r["flops_curve"], r["curve"])], flops)
                        for n, r in results["runs"].items() if "flops_curve" in r}}
    checkpoints = {name: import_peer(d, work) if name == "peer" else d
                   for name, d in runs.items()}
    for name, checkpoint in checkpoints.items():
        # The peer's fine-tuning is kept per learning rate: another lr may win a later sweep.
        accuracy = downstream(runs[name].name if name == "peer" else name, checkpoint, work,
                              args)
        results["runs"][name]["topic_accuracy"] = accuracy
        results["runs"][name]["topic_accuracy_se"] = math.sqrt(
            accuracy * (1 - accuracy) / TOPIC_TEST_ROWS)
    results["wall_s"] = round(time.time() - started)
    results["ended_utc"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results["loadavg_at_end"] = os.getloadavg()
    (work / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, work / "time_to_quality.png")
    print_table(results)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


LABELS = {"peer": "transformers BertForMaskedLM (best lr, BF16)",
          "popbert-same": "popbert, the same recipe",
          "popbert-fast": "popbert --config fast (ModernBERT)",
          "popbert-groupbert-fast": "popbert --config groupbert-fast"}


def plot(results: dict, path: Path) -> None:
    """Validation loss against training seconds and, beside it, against training FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget, target = results["budget_s"], results["target_val_mlm_loss"]
    fig, (by_time, by_flops) = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for name, r in results["runs"].items():
        line, = by_time.plot(*zip(*r["curve"]), marker="o", markersize=3,
                             label=LABELS.get(name, name))
        if "flops_curve" in r:
            by_flops.plot([f / 1e12 for f, _ in r["flops_curve"]],
                          [loss for _, loss in r["flops_curve"]], marker="o", markersize=3,
                          color=line.get_color(), label=LABELS.get(name, name))
    for ax in (by_time, by_flops):
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls="--", label="the peer's final loss")
        ax.grid(alpha=0.3)
    if "equal_flops" in results:
        by_flops.axvline(results["equal_flops"]["training_flops"] / 1e12, color="grey", lw=0.8,
                         ls=":", label="equal training FLOPs")
    by_time.set_xlabel(f"training seconds ({results.get('threads', '?')}-core CPU)")
    by_time.set_ylabel("validation MLM loss")
    by_time.set_xlim(0, budget * 1.02)
    by_time.set_title(f"Time to quality, {budget:g} s budget, held-out Wikipedia leads")
    by_time.legend(fontsize=8)
    by_flops.set_xlabel("training TFLOP (popbert plan: 3 x forward matmuls)")
    by_flops.set_title("the same runs against training FLOPs")
    by_flops.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: dict) -> None:
    if results["peer_lrs"]:
        print(f"\nbudget {results['budget_s']:g} s; peer lr sweep (final val MLM loss): "
              + ", ".join(f"{k}: {v:.3f}" for k, v in results["peer_lrs"].items()))
    else:
        print(f"\nbudget {results['budget_s']:g} s")
    target, reference = results["target_val_mlm_loss"], results["reference_final_val_mlm_loss"]
    head = ["run", "steps", "s/step", "GFLOP/step", "final val MLM loss"]
    if target is not None:
        head += [f"s to the peer's final loss ({target:.3f})", "ratio vs the peer"]
    if reference is not None:
        name = results["reference_run"]
        head += [f"s to {name}'s final loss ({reference:.3f})", f"{name}'s s / run's s"]
    head += ["topic accuracy (± s.e.)"]
    print("| " + " | ".join(head) + " |")
    print("| --- |" + " ---: |" * (len(head) - 1))

    def seconds(value: float | None) -> str:
        return f"{value:.0f}" if value else "not reached"

    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value else "-"

    for name, r in results["runs"].items():
        per_step = r.get("training_flops_per_step")
        cells = [name, f"{r['steps']:,}", f"{r['s_per_step']:.3f}",
                 f"{per_step / 1e9:.1f}" if per_step else "-", f"{r['final_val_mlm_loss']:.3f}"]
        if target is not None:
            cells += [seconds(r["seconds_to_target"]), ratio(r["ratio"])]
        if reference is not None:
            cells += [seconds(r["seconds_to_reference_final"]), ratio(r["reference_time_ratio"])]
        acc = r.get("topic_accuracy")
        cells.append(f"{acc:.3f} ± {r['topic_accuracy_se']:.3f}" if acc is not None else "-")
        print("| " + " | ".join(cells) + " |")
    equal = results.get("equal_flops")
    if equal:
        print(f"\nequal training FLOPs: {equal['training_flops'] / 1e12:.1f} TFLOP (the total "
              f"{equal['set_by']} reached in the budget)")
        print("| run | val MLM loss there | training seconds there |")
        print("| --- | ---: | ---: |")
        for name, loss in equal["val_mlm_loss"].items():
            t = equal["seconds"][name]
            print(f"| {name} | {f'{loss:.3f}' if loss is not None else 'not reached'} | "
                  f"{f'{t:.0f}' if t is not None else '-'} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("peer", help="(internal) one peer run")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--train", type=Path, required=True)
    p.add_argument("--validation", type=Path, required=True)
    p.add_argument("--eval-points", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=12)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--compile", action="store_true")
    parser.add_argument("--budget", type=float, default=420, help="seconds of training per run")
    parser.add_argument("--peer-lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3])
    parser.add_argument("--peer-compile", action="store_true",
                        help="torch.compile the peer's step (measured slower on 2-core CPUs)")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                        help="the runs to do and report (default: all)")
    parser.add_argument("--fast-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra --set for the fast run (ablations)")
    parser.add_argument("--groupbert-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra --set for the groupbert-fast run")
    parser.add_argument("--eval-points", type=int, default=12)
    parser.add_argument("--finetune-epochs", type=int, default=3)
    parser.add_argument("--finetune-lr", type=float, default=1e-4)
    parser.add_argument("--work-dir", default="runs/time-to-quality")
    arguments = parser.parse_args()
    if arguments.command == "peer":
        peer_main(arguments)
    else:
        main(arguments)
