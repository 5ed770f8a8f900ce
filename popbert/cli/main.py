"""The `popbert` command: pretrain, fine-tune, evaluate, predict, export, import/export
Hugging Face checkpoints, show a resolved config, plot metrics.

User mistakes (bad config, missing checkpoint, unusable data) end as one line
`popbert: error: <message>` on stderr with exit status 2, like argparse's own usage errors; a
traceback means a bug. Heavy modules (torch) are imported inside the handlers, so config errors
are reported in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from popbert import __version__
from popbert.errors import PopbertError, UsageError, one_line
from popbert.io import paths
from popbert.rules import EXPORT_DEVICE, PER_MACHINE, SEED

if TYPE_CHECKING:
    from popbert.config import RunConfig

logger = logging.getLogger("popbert")

_HANDLER_MARK = "_popbert_cli_handler"


def _configure_logging(verbose: bool) -> None:
    """Install one stderr handler on the root logger (once per process), set the levels.

    popbert's own loggers log at INFO (DEBUG with -v); other libraries only at WARNING (INFO
    with -v), so e.g. matplotlib's font-cache notice never lands between a run's messages.
    """
    root = logging.getLogger()
    if not any(getattr(h, _HANDLER_MARK, False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        setattr(handler, _HANDLER_MARK, True)
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("popbert").setLevel(logging.DEBUG if verbose else logging.INFO)


def _user_error_types() -> tuple[type[BaseException], ...]:
    """PopbertError plus popbert.data's DataError where that module is loaded.

    A DataError can only have been raised if its module was imported, so this looks in
    sys.modules instead of importing popbert.data (which pulls in torch: a second per error).
    """
    types_: list[type[BaseException]] = [PopbertError]
    data_errors = sys.modules.get("popbert.data.errors")
    data_error = getattr(data_errors, "DataError", None)
    if isinstance(data_error, type) and issubclass(data_error, BaseException):
        types_.append(data_error)
    return tuple(types_)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """--config (default: the preset tiny, or the resumed run's own config) under --set."""
    from popbert.config import DEFAULT_PRESET, load_config

    config = args.config
    resume = getattr(args, "resume", None)
    if config is None and resume is not None and (resume / "config.yaml").is_file():
        # Resuming without --config continues with the config the run was started with (a run
        # directory and each of its checkpoints hold it).
        config = resume / "config.yaml"
    return load_config(config if config is not None else DEFAULT_PRESET, args.overrides)


def pretrain_output_dir(args: argparse.Namespace) -> Path:
    """--output-dir; else the resumed run's own directory; else runs/pretrain-<timestamp>."""
    if args.output_dir is not None:
        return args.output_dir
    if args.resume is not None:
        from popbert.io.run_dir import run_dir_of

        return run_dir_of(args.resume)  # a resumed run continues where it was
    from popbert.io.run_dir import default_run_dir

    return default_run_dir("pretrain")


def _cmd_pretrain(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from popbert.train.trainer import Trainer

    # A torchrun restart of this job resumes its own run by itself (Trainer.from_config).
    with Trainer.from_config(cfg, pretrain_output_dir(args), resume=args.resume,
                             init_from=args.init_from, overwrite=args.overwrite) as trainer:
        trainer.train()
    return 0


def _names(text: str, known: Sequence[str], flag: str, what: str) -> tuple[str, ...]:
    """A comma-separated list of `known` names; "all" → every one, "none" (or "") → ()."""
    if text.strip() == "all":
        return tuple(known)
    names = tuple(n.strip() for n in text.split(",") if n.strip() not in ("", "none"))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"{flag}: unknown {what} {unknown[0]!r}; expected all, none or a "
                         f"comma-separated list of {', '.join(known)}")
    return names


def _cmd_export(args: argparse.Namespace) -> int:
    from popbert.export.inference import export_checkpoint

    # Only options the user set are passed, so export_checkpoint's defaults stay the one source.
    options = {key: getattr(args, key) for key in ("batch_size", "sequence_length")
               if getattr(args, key) is not None}
    if args.dtype != "float32":
        options["dtype"] = args.dtype
    if args.optimize:
        options["optimize"] = True
    if args.fusions is not None:
        from popbert.export.fused import ALL_FUSIONS

        options["fusions"] = _names(args.fusions, ALL_FUSIONS, "--fusions", "fused operator")
    if args.quantize:
        options["quantize"] = args.quantize
    if args.keep_float is not None:
        from popbert.export.quantize import ALL_ROLES

        options["keep_float"] = _names(args.keep_float, ALL_ROLES, "--keep-float", "role")
    if args.runtime != "onnxruntime":
        options["runtime"] = args.runtime
    if args.precision != "auto":
        options["precision"] = args.precision
    if args.calibration is not None:
        options["calibration"] = args.calibration
    if args.eval is not None:
        options["eval_data"] = args.eval
    if args.max_accuracy_drop is not None:
        if not args.max_accuracy_drop >= 0:
            raise UsageError(f"--max-accuracy-drop: expected points >= 0, got "
                             f"{args.max_accuracy_drop:g}")
        options["max_accuracy_drop"] = args.max_accuracy_drop
    path = export_checkpoint(checkpoint=args.checkpoint, task=args.task, output=args.output,
                             **options)
    logger.info("wrote %s", path)
    return 0


def _cmd_import_hf(args: argparse.Namespace) -> int:
    from popbert.hf.checkpoint import import_hf

    report = import_hf(args.model, args.output_dir, sequence_length=args.sequence_length,
                       seed=args.seed)
    logger.info("wrote %s: %d tensors from the checkpoint, %d initialised fresh, %d ignored",
                report.output_dir, len(report.loaded), len(report.fresh), len(report.ignored))
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from popbert.hf.checkpoint import export_hf

    export_hf(args.checkpoint, args.output_dir, architecture=args.architecture)
    return 0


def _print_json(result: dict) -> None:
    """Results go to stdout as one JSON line (the last), logs to stderr."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def finetune_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The fine-tuning run's config: --config (default: the task's preset) with the flags the
    user gave (each one config key, `popbert.train.finetune.FLAG_KEYS`), then --set."""
    from popbert.tasks import TASKS
    from popbert.train.finetune import FLAG_KEYS, finetune_config

    given = {dest: getattr(args, dest) for dest in FLAG_KEYS
             if getattr(args, dest, None) is not None}
    for flag in TASKS[args.finetune_task].flags:  # "a,b,c" → a list
        if flag.list_of_text and isinstance(given.get(flag.dest), str):
            given[flag.dest] = [x.strip() for x in given[flag.dest].split(",")]
    _check_flag_values(given, FLAG_KEYS)
    flags = [f"{FLAG_KEYS[dest]}={json.dumps(str(v) if isinstance(v, Path) else v)}"
             for dest, v in given.items() if dest not in ("checkpoint", "train")]
    return finetune_config(args.finetune_task, args.checkpoint, args.train,
                           overrides=[*flags, *args.overrides], config=args.config)


def _check_flag_values(given: dict[str, Any], keys: dict[str, str]) -> None:
    """A flag's value that breaks its config key's rule is one line naming the flag (not the
    `--set` it becomes)."""
    from popbert.config.sections import SECTIONS
    from popbert.rules import rule_of

    for dest, value in given.items():
        section, name = keys[dest].split(".", 1)
        rule = rule_of(SECTIONS[section], name) if "." not in name else None
        if rule is not None and not rule.allows(value):
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} {value}: {rule.message(keys[dest], value)}")


def _cmd_finetune(args: argparse.Namespace) -> int:
    cfg = finetune_config_from_args(args)
    from popbert.train.trainer import Trainer

    with Trainer.from_config(cfg, args.output_dir, overwrite=args.overwrite) as trainer:
        result = trainer.train()
    logger.info("wrote %s (checkpoint %s)", result.output_dir, result.checkpoint.name)
    from popbert.tasks import TASKS

    if result.metrics or TASKS[args.finetune_task].always_print_metrics:
        _print_json(result.metrics)
    return 0


def _cmd_evaluate_retrieval(args: argparse.Namespace) -> int:
    from popbert.serve.embed import evaluate_retrieval  # ONNX Runtime only: no torch

    _print_json(evaluate_retrieval(args.model, args.beir, args.split,
                                   batch_size=args.batch_size, threads=args.threads,
                                   query_prompt=args.query_prompt,
                                   document_prompt=args.document_prompt, device=args.device))
    return 0


def _cmd_evaluate_rerank(args: argparse.Namespace) -> int:
    from popbert.serve.rerank import evaluate_rerank  # ONNX Runtime only: no torch

    _print_json(evaluate_rerank(args.model, args.beir, args.split, args.run,
                                batch_size=args.batch_size, threads=args.threads,
                                device=args.device))
    return 0


def _cmd_predict_ner(args: argparse.Namespace) -> int:
    from popbert.serve.tag import predict_ner  # ONNX Runtime only: no torch

    metrics = predict_ner(args.model, args.data, args.output, batch_size=args.batch_size,
                          threads=args.threads, scheme=args.tag_scheme, device=args.device)
    logger.info("wrote %s", args.output)
    if metrics is not None:
        _print_json(metrics)
    return 0


def _cmd_predict_embed(args: argparse.Namespace) -> int:
    from popbert.serve.embed import predict_embed  # ONNX Runtime only: no torch

    predict_embed(args.model, args.data, args.output, batch_size=args.batch_size,
                  threads=args.threads, fmt=args.format, prompt=args.prompt,
                  text_column=args.text_column, device=args.device)
    logger.info("wrote %s", args.output)
    return 0


def _cmd_predict_rerank(args: argparse.Namespace) -> int:
    from popbert.serve.rerank import predict_rerank  # ONNX Runtime only: no torch

    predict_rerank(args.model, args.data, args.output, batch_size=args.batch_size,
                   threads=args.threads, device=args.device)
    logger.info("wrote %s", args.output)
    return 0


def _add_rerank_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx",
                   help="a classification export with one output (finetune classify "
                        "--regression) or two labels, the second 'relevant'")
    _add_runtime_options(p, 32, "pairs per run")


EXPORT_DEVICE_HELP = ("cpu (ONNX Runtime, or OpenVINO for an IR; the default), or cuda or "
                      "cuda:N: a GPU, through popbert's torch backend, for an FP32 or FP16 "
                      "ONNX export")


def _add_runtime_options(p: argparse.ArgumentParser, batch_size: int, per_run: str) -> None:
    """How an export is run by the commands that serve it (predict, evaluate)."""
    p.add_argument("--batch-size", type=int, default=batch_size, help=per_run)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--device", type=_export_device, default=None, metavar="DEVICE",
                   help=EXPORT_DEVICE_HELP)


def _export_device(text: str) -> str | None:
    """--device of the commands that run an export: None for the CPU's runtimes."""
    if not EXPORT_DEVICE.allows(text):
        raise argparse.ArgumentTypeError(f"expected {EXPORT_DEVICE.expected}, got {text!r}")
    return None if text == "cpu" else text


def _cmd_evaluate_squad(args: argparse.Namespace) -> int:
    from popbert.data.squad import evaluate_files

    _print_json(evaluate_files(args.data, args.predictions))
    return 0


def _cmd_predict_squad(args: argparse.Namespace) -> int:
    from popbert.serve.predict import predict_squad  # ONNX Runtime only: no torch on this path

    predict_squad(args.model, args.data, args.output, n_best_size=args.n_best_size,
                  max_answer_length=args.max_answer_length, batch_size=args.batch_size,
                  threads=args.threads, device=args.device)
    logger.info("wrote %s", args.output)
    return 0


def _cmd_predict_classify(args: argparse.Namespace) -> int:
    from popbert.serve.predict import predict_classify  # ONNX Runtime only: no torch

    metrics = predict_classify(args.model, args.data, args.output, batch_size=args.batch_size,
                               threads=args.threads, text_column=args.text_column,
                               pair_column=args.text_pair_column,
                               label_column=args.label_column, device=args.device)
    logger.info("wrote %s", args.output)
    if metrics is not None:
        _print_json(metrics)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from popbert.config.loading import DEFAULT_PRESET, load_config
    from popbert.config.sections import ServeConfig

    try:
        from popbert.serve.server import serve
    except ImportError as missing:  # fastapi, uvicorn, prometheus-client: the serve extra
        raise UsageError(f"popbert serve needs {missing.name}: pip install "
                         "'popbert[serve]'") from None
    config = (load_config(args.config or DEFAULT_PRESET, args.overrides).serve
              if args.config or args.overrides else ServeConfig())
    given = {key: getattr(args, key) for key in (f.name for f in dataclasses.fields(ServeConfig))
             if getattr(args, key, None) is not None}
    _check_flag_values(given, {key: f"serve.{key}" for key in given})
    for key, value in given.items():
        setattr(config, key, str(value) if isinstance(value, Path) else value)
    return serve(args.model, config, args.api_key)


def _cmd_config(args: argparse.Namespace) -> int:
    from popbert.atomic import atomic_write_text
    from popbert.config import dump_config, warn_config

    cfg = config_from_args(args)
    warn_config(cfg)
    if args.output is not None:
        atomic_write_text(args.output, dump_config(cfg))
        logger.info("wrote %s", args.output)
    else:
        sys.stdout.write(dump_config(cfg))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Memory and FLOPs per device and stage from the graph and config alone (no torch)."""
    from popbert.plan import custom_device, device_named, plan_dict, plan_run, plan_table

    target = None
    if args.device is not None:  # checked before the graph is built: a typo fails at once
        target = device_named(args.device)
    elif args.memory_gb is not None:
        target = custom_device(args.memory_gb)
    cfg = config_from_args(args)
    name = Path(args.config).name if args.config is not None else "tiny"
    plan = plan_run(cfg, target, config_name=name)
    if args.json:
        _print_json(plan_dict(plan))
    else:
        sys.stdout.write(plan_table(plan))
    return 1 if plan.fits is False else 0  # like a compile that runs out of memory


def _cmd_plot(args: argparse.Namespace) -> int:
    """One run (its metrics.jsonl or directory): its full plot; several, or --metric: overlaid."""
    if len(args.paths) == 1 and not args.metric:
        from popbert.observe.plots import plot_metrics

        metrics = args.paths[0]
        if metrics.is_dir():
            metrics = metrics / "metrics.jsonl"
        output = args.output if args.output is not None else metrics.with_suffix(".png")
        path = plot_metrics(metrics, output)
    else:
        from popbert.observe.compare import compare_runs

        path = compare_runs(args.paths, args.output if args.output is not None
                            else Path("compare.png"), metrics=args.metric)
    logger.info("wrote %s", path)
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE_OR_PRESET", default=None,
                   type=paths.CONFIG_FILE,
                   help="YAML config file or preset name (tiny, base-128, base-384, large-128, "
                        "large-384); default: tiny")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                   default=[], help="override one config value, in YAML syntax, e.g. "
                                    "--set optimizer.lr=1e-3 --set 'model.layers_per_ipu=[1,1]'")


def add_pretrain_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `popbert pretrain` (examples/pretrain.py takes the same)."""
    _add_config_args(p)
    p.add_argument("--output-dir", "-o", type=paths.OUTPUT_DIR, default=None, metavar="DIR",
                   help="run directory (checkpoints, metrics); default runs/pretrain-<timestamp>")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", type=paths.RUN, default=None, metavar="DIR",
                       help="continue a run (its directory, or one of its checkpoints) from "
                            "the checkpoint: weights, optimizer, data position, RNG; the run "
                            "continues in that directory unless --output-dir says otherwise")
    start.add_argument("--init-from", type=paths.CHECKPOINT, default=None, metavar="DIR",
                       help="start a new run from a checkpoint's weights only (e.g. phase 2)")
    _add_overwrite_arg(p)


_OVERWRITE_HELP = ("delete an earlier run in the output directory first (a new run refuses a "
                   "directory holding another run; one that also holds files popbert did not "
                   "write is never cleared)")


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)


def _add_training_args(p: argparse.ArgumentParser, preset: str) -> None:
    """The flags of `popbert finetune TASK`: each sets one config key over the task's preset
    (`popbert config --config PRESET` shows its values); --set reaches every other key."""
    from popbert.config.sections import DEVICE

    def device(value: str) -> str:  # execution.device's own rule, so "cuda:1" passes too
        if not DEVICE.allows(value):
            raise argparse.ArgumentTypeError(f"expected {DEVICE.expected}, got {value!r}")
        return value

    p.add_argument("--checkpoint", type=paths.CHECKPOINT, required=True, metavar="DIR",
                   help="checkpoint or run directory (popbert pretrain, import-hf)")
    p.add_argument("--output-dir", "-o", type=paths.OUTPUT_DIR, required=True, metavar="DIR")
    _add_overwrite_arg(p)
    p.add_argument("--config", "-c", metavar="FILE_OR_PRESET", default=None,
                   type=paths.CONFIG_FILE,
                   help=f"YAML config or preset to start from (default: {preset})")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                   default=[], help="override one config value, e.g. --set optimizer.lr=3e-5")
    p.add_argument("--max-seq-length", type=int, metavar="N", help="finetune.max_seq_length")
    p.add_argument("--epochs", type=int, help="finetune.epochs")
    p.add_argument("--lr", type=float, help="peak learning rate (AdamW): optimizer.lr")
    p.add_argument("--batch-size", type=int, help="execution.micro_batch_size")
    p.add_argument("--warmup-proportion", type=float,
                   help="fraction of the steps with linear warmup (then linear decay to 0): "
                        "finetune.warmup_proportion")
    p.add_argument("--weight-decay", type=float, help="optimizer.weight_decay")
    p.add_argument("--max-grad-norm", type=float, help="optimizer.max_grad_norm")
    p.add_argument("--seed", type=int, help="training.seed")
    p.add_argument("--device", type=device, metavar="DEVICE",
                   help=f"execution.device: {DEVICE.expected}")
    p.add_argument("--threads", type=int, help="torch intra-op threads: execution.threads")
    p.add_argument("--log-every", type=int, metavar="STEPS", help="training.log_every")
    p.add_argument("--eval-batch-size", type=int, help="finetune.eval_batch_size")
    p.add_argument("--dropout", type=float, metavar="P",
                   help="hidden and attention dropout (default: the checkpoint's; 0.1 for "
                        "GroupBERT, which pre-trains without): finetune.dropout")


# by `popbert.tasks.Task.files`
TRAINING_METAVARS = {"squad": "FILE.json", "rows": "FILE", "tagged": "FILE", "pairs": "FILE"}


def _add_finetune_commands(sub, common: argparse.ArgumentParser) -> None:
    """`popbert finetune <command>` for each task of `popbert.tasks.TASKS`: the flags every
    task takes, then the task's own (each one config key)."""
    from popbert.tasks import TASKS

    group = sub.add_parser("finetune", parents=[common], help="fine-tune on a task: "
                           + ", ".join(task.command for task in TASKS.values()))
    commands = group.add_subparsers(dest="finetune_command", metavar="TASK", required=True)
    for task in TASKS.values():
        p = commands.add_parser(task.command, parents=[common], help=task.help,
                                description=task.description, aliases=list(task.aliases))
        _add_training_args(p, task.preset)
        p.add_argument("--train", type=paths.TRAINING_FILES[task.files], required=True,
                       metavar=TRAINING_METAVARS[task.files])
        for flag in task.flags:
            options = {"default": None, **flag.options}
            if flag.file is not None:
                options["type"] = paths.TRAINING_FILES[flag.file]
            p.add_argument(flag.name, **options)
        p.set_defaults(handler=_cmd_finetune, finetune_task=task.name)


def _add_evaluate_commands(sub, common: argparse.ArgumentParser) -> None:
    group = sub.add_parser("evaluate", parents=[common], help="score predictions")
    tasks = group.add_subparsers(dest="evaluate_task", metavar="TASK", required=True)
    p = tasks.add_parser("squad", parents=[common],
                         help="official SQuAD v1.1 exact match and F1",
                         description="Print {\"exact_match\": ..., \"f1\": ...} (percent) as "
                                     "the last line, as the official v1.1 script does.")
    p.add_argument("--data", type=paths.SQUAD, required=True, metavar="FILE.json")
    p.add_argument("--predictions", type=paths.PREDICTIONS, required=True, metavar="FILE.json")
    p.set_defaults(handler=_cmd_evaluate_squad)
    p = tasks.add_parser("rerank", parents=[common],
                         help="a cross-encoder's nDCG@10, MRR@10 and Recall@100 on a BEIR "
                              "directory",
                         description="Score every (judged query, document) pair, rank each "
                                     "query's documents and print the metrics as JSON.")
    _add_rerank_options(p)
    p.add_argument("--beir", type=paths.BEIR, required=True, metavar="DIR")
    p.add_argument("--split", default="test", help="qrels/<split>.tsv (default: test)")
    p.add_argument("--run", type=paths.TREC_RUN_OUTPUT, default=None, metavar="FILE",
                   help="also write the ranking in TREC's run format")
    p.set_defaults(handler=_cmd_evaluate_rerank)
    p = tasks.add_parser("retrieval", parents=[common],
                         help="an embedding export's nDCG@10, MRR@10 and Recall@100 on a BEIR "
                              "directory",
                         description="Embed the judged queries and the whole corpus, rank by "
                                     "cosine similarity (exact search), print the metrics as "
                                     "JSON.")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx",
                   help="a `popbert export --task embedding` model")
    p.add_argument("--beir", type=paths.BEIR, required=True, metavar="DIR")
    p.add_argument("--split", default="test", help="qrels/<split>.tsv (default: test)")
    p.add_argument("--query-prompt", default=None, metavar="NAME",
                   help="the model's prompt put before each query (e.g. query)")
    p.add_argument("--document-prompt", default=None, metavar="NAME",
                   help="the model's prompt put before each document")
    _add_runtime_options(p, 32, "texts per run")
    p.set_defaults(handler=_cmd_evaluate_retrieval)


def _add_predict_commands(sub, common: argparse.ArgumentParser) -> None:
    group = sub.add_parser("predict", parents=[common],
                           help="run an exported model in ONNX Runtime")
    tasks = group.add_subparsers(dest="predict_task", metavar="TASK", required=True)
    p = tasks.add_parser("squad", parents=[common],
                         help="answer SQuAD-format questions with a squad ONNX export",
                         description="ONNX Runtime only (torch is not imported).")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx")
    p.add_argument("--data", type=paths.SQUAD, required=True, metavar="FILE.json")
    p.add_argument("--output", "-o", type=paths.SQUAD_PREDICTIONS_OUTPUT,
                   default=Path("predictions.json"),
                   metavar="FILE.json")
    p.add_argument("--n-best-size", type=int, default=20)
    p.add_argument("--max-answer-length", type=int, default=30)
    _add_runtime_options(p, 16, "windows per run (a fixed-batch export uses its own)")
    p.set_defaults(handler=_cmd_predict_squad)
    p = tasks.add_parser("classify", parents=[common],
                         help="label texts with a classification ONNX export",
                         description="Label every row of a TSV/CSV/JSONL file (columns as in "
                                     "`finetune classify`) or every line of a .txt file; write "
                                     "JSON lines with the label and each label's probability, "
                                     "and print accuracy and F1 if the file has labels.")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx")
    p.add_argument("--data", type=paths.ROWS_OR_LINES, required=True, metavar="FILE")
    p.add_argument("--output", "-o", type=paths.LABELS_OUTPUT, default=Path("predictions.jsonl"),
                   metavar="FILE.jsonl")
    p.add_argument("--text-column", default=None,
                   help="text column (default: the first of sentence, text, sentence1, ...)")
    p.add_argument("--text-pair-column", default=None,
                   help="second text column of sentence pairs")
    p.add_argument("--label-column", default=None,
                   help="gold labels, scored (default: the label column, where the file has "
                        "one)")
    _add_runtime_options(p, 16, "rows per run (a fixed-batch export uses its own)")
    p.set_defaults(handler=_cmd_predict_classify)
    p = tasks.add_parser("embed", parents=[common],
                         help="one vector per text with an embedding export",
                         description="Embed every line of a .txt file (or every row of a "
                                     "TSV/CSV/JSONL file's text column) with a `popbert export "
                                     "--task embedding` model: JSON lines of \"embedding\", "
                                     "or a .npy array [texts, hidden].")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx")
    p.add_argument("--data", type=paths.ROWS_OR_LINES, required=True, metavar="FILE")
    p.add_argument("--output", "-o", type=paths.EMBEDDINGS_OUTPUT,
                   default=Path("embeddings.jsonl"), metavar="FILE.jsonl|FILE.npy")
    p.add_argument("--format", choices=("jsonl", "npy"), default=None,
                   help="default: npy for a .npy output, else jsonl")
    p.add_argument("--prompt", default=None, metavar="NAME",
                   help="put the model's prompt of this name first (e.g. query), as "
                        "sentence-transformers' encode(prompt_name=...)")
    p.add_argument("--text-column", default=None, help="rows' text column")
    _add_runtime_options(p, 32, "texts per run")
    p.set_defaults(handler=_cmd_predict_embed)
    p = tasks.add_parser("ner", parents=[common], aliases=["token-classification"],
                         help="tag each word with a token-classification export",
                         description="Read CoNLL (the word first; a tag last is scored) or JSON "
                                     "lines of \"tokens\" (and \"tags\"); write the same "
                                     "format with each word's predicted IOB2 tag (CoNLL: as the "
                                     "last column); print entity precision, recall and F1 when "
                                     "the file has tags.")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="FILE.onnx")
    p.add_argument("--data", type=paths.TAGGED, required=True, metavar="FILE")
    p.add_argument("--output", "-o", type=paths.TAGGED_OUTPUT, required=True, metavar="FILE")
    p.add_argument("--tag-scheme", choices=("IOB1", "IOB2", "BIOES"), default=None,
                   help="the file's tag scheme, when it has tags (default: detected)")
    _add_runtime_options(p, 16, "windows per run")
    p.set_defaults(handler=_cmd_predict_ner)
    p = tasks.add_parser("rerank", parents=[common],
                         help="sort each query's candidates by a cross-encoder's score",
                         description="Read JSON lines {\"query\": ..., \"candidates\": [text "
                                     "or {\"id\", \"text\"}, ...]}; write them with the "
                                     "candidates sorted by score, highest first.")
    _add_rerank_options(p)
    p.add_argument("--data", type=paths.RERANK_ROWS, required=True, metavar="FILE.jsonl")
    p.add_argument("--output", "-o", type=paths.RANKED_OUTPUT, default=Path("ranked.jsonl"),
                   metavar="FILE.jsonl")
    p.set_defaults(handler=_cmd_predict_rerank)


def _add_serve_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """`popbert serve`: an export behind HTTP; each flag is a key of the config's serve
    section (flags win over --config and --set)."""
    p = sub.add_parser("serve", parents=[common],
                       help="serve an export over HTTP (OpenAI and TEI routes)",
                       description="Serve any `popbert export` (ONNX, INT8, OpenVINO IR) over "
                                   "HTTP: POST /v1/embeddings (OpenAI), /embed, /predict, "
                                   "/rerank, /tokenize (Text Embeddings Inference), GET "
                                   "/health, /info, /metrics (Prometheus), /docs. Requests "
                                   "from all clients are batched by a token budget. SIGTERM "
                                   "or SIGINT: stop accepting, answer what was accepted, exit "
                                   "0; a second SIGINT: stop at once, exit 130.")
    p.add_argument("--model", type=paths.ONNX_MODEL, required=True, metavar="EXPORT")
    p.add_argument("--config", "-c", metavar="FILE", default=None, type=paths.CONFIG_FILE,
                   help="a YAML config whose serve: section holds these settings")
    p.add_argument("--set", dest="overrides", metavar="serve.KEY=VALUE", action="append",
                   default=[], help="override one serve setting, e.g. --set serve.port=9000")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default 8080")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` (all routes but /health); "
                        "prefer the environment's POPBERT_API_KEY, which no process list shows")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and requests (default: the export's "
                        "file stem)")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="tokens (rows x the longest) in one model run (default 16384)")
    p.add_argument("--max-wait-ms", type=float, default=None, metavar="MS",
                   help="how long a batch waits for requests on their way (default 5)")
    p.add_argument("--max-padding", type=float, default=None, metavar="SHARE",
                   help="the share of a batch's tokens that may be padding; rows further apart "
                        "in length run in separate batches (default 0.1)")
    p.add_argument("--max-batch-rows", type=int, default=None, metavar="N",
                   help="rows in one model run (default: unbounded, but 1 for a dynamic-INT8 "
                        "export, so a text's vector does not depend on its batch)")
    p.add_argument("--max-input-tokens", type=int, default=None, metavar="N",
                   help="longest input; longer ones are truncated (\"truncate\": false: 413) "
                        "(default: the export's length)")
    p.add_argument("--default-prompt-name", default=None, metavar="NAME",
                   help="an embedding export's prompt put before every text whose request "
                        "names no prompt_name (OpenAI's clients cannot name one)")
    p.add_argument("--default-prompt", default=None, metavar="TEXT",
                   help="the same, as the prompt's text (e.g. \"query: \")")
    p.add_argument("--max-client-batch-size", type=int, default=None, metavar="N",
                   help="inputs in one request; more: 413 (default 256)")
    p.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                   help="requests in flight; more: 503 with Retry-After (default 512)")
    p.add_argument("--payload-limit", type=int, default=None, metavar="BYTES",
                   help="largest request body; larger: 413 (default 2000000)")
    p.add_argument("--client-timeout-s", type=float, default=None, metavar="SECONDS",
                   help="time a client has to send its body (else 408) and to take its answer "
                        "(else it is dropped), so stalled clients free their places and a stop "
                        "ends (default 20)")
    p.add_argument("--cors-allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="an origin (https://app.example.com, or *) whose web pages may call "
                        "the server from a browser; repeat for more (default: none)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes sharing the port, each with the model (default 1)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="the runtime's intra-op threads per worker (default: the runtime's "
                        "with one worker; with more, each worker's share of the CPUs)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help=EXPORT_DEVICE_HELP)
    p.add_argument("--ssl-certfile", type=paths.PEM, default=None, metavar="FILE.pem",
                   help="TLS certificate (PEM)")
    p.add_argument("--ssl-keyfile", type=paths.PEM, default=None, metavar="FILE.pem",
                   help="TLS private key (PEM)")
    p.add_argument("--access-log", action="store_const", const=True, default=None,
                   help="log every request (uvicorn's access log)")
    p.set_defaults(handler=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the `popbert` command."""
    parser = argparse.ArgumentParser(
        prog="popbert", description="Pre-train and fine-tune BERT from an annotated ONNX graph.")
    parser.add_argument("--version", action="version", version=f"popbert {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: `popbert -v pretrain` is not reset to False by the subcommand's own default.
    common.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("pretrain", parents=[common], help="pre-train BERT (MLM + NSP)",
                       description="Pre-train BERT. With no arguments: the tiny preset on the "
                                   "bundled corpus, on CPU, in a couple of minutes.")
    add_pretrain_arguments(p)
    p.set_defaults(handler=_cmd_pretrain)

    _add_finetune_commands(sub, common)
    _add_evaluate_commands(sub, common)
    _add_predict_commands(sub, common)

    p = sub.add_parser("export", parents=[common], help="export a checkpoint to inference ONNX "
                       "(or OpenVINO IR)",
                       description="Write a standard-opset ONNX model with the checkpoint's "
                                   "weights, verified in ONNX Runtime against the torch backend "
                                   "(--runtime openvino: an OpenVINO IR, verified in OpenVINO).")
    p.add_argument("--checkpoint", type=paths.CHECKPOINT, required=True, metavar="DIR")
    from popbert.tasks import TASKS

    p.add_argument("--task", choices=("pretraining", "encoder", *TASKS),
                   required=True,
                   help="pretraining: MLM + NSP heads; encoder: last hidden state and pooled "
                        "output (like transformers.BertModel); embedding: one pooled (and, "
                        "as model.task says, normalised) vector per text, as "
                        "sentence-transformers encodes; a fine-tuning task's outputs ("
                        + "; ".join(f"{name}: {', '.join(task.outputs)}"
                                    for name, task in TASKS.items())
                        + ") need a checkpoint fine-tuned for it")
    p.add_argument("--output", type=paths.EXPORT_OUTPUT, required=True, metavar="FILE.onnx|DIR",
                   help="the ONNX file; with --runtime openvino, the IR directory")
    p.add_argument("--runtime", choices=("onnxruntime", "openvino"), default="onnxruntime",
                   help="onnxruntime: an ONNX file (default); openvino: an OpenVINO IR "
                        "directory (model.xml, model.bin) converted from the FP32 export, for "
                        "Intel and AMD CPUs (pip install 'popbert[openvino]')")
    p.add_argument("--calibration", type=paths.TASK_DATA, default=None, metavar="FILE",
                   help="with --runtime openvino --quantize int8: the rows static INT8 "
                        "calibrates on (the formats of --eval; default: the first 300 rows of "
                        "the checkpoint's training file)")
    p.add_argument("--precision", choices=("auto", "f32", "bf16"), default="auto",
                   help="with --runtime openvino: the precision OpenVINO runs at; auto: BF16 "
                        "on CPUs with AVX512-BF16 or AMX, else f32")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="float16: half-precision weights and compute (for GPU providers)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--dynamic-batch", action="store_true",
                       help="symbolic batch dimension (the default)")
    batch.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help="fix the batch dimension to N instead")
    p.add_argument("--sequence-length", type=int, default=None, metavar="N",
                   help="fix the input length to N (default: a symbolic sequence axis, any "
                        "length up to model.max_position_embeddings)")
    p.add_argument("--optimize", action="store_true",
                   help="write ONNX Runtime's fused BERT operators that pay on its CPU "
                        "provider (Attention, EmbedLayerNormalization); float32 only, checked "
                        "like the plain export")
    p.add_argument("--fusions", default=None, metavar="LIST",
                   help="with --optimize: the fused operators to write instead, "
                        "comma-separated from Attention, EmbedLayerNormalization, "
                        "SkipLayerNormalization, BiasGelu, or all (for GPU providers)")
    p.add_argument("--quantize", choices=("int8",), default=None,
                   help="int8: dynamic INT8 weight matrices (per channel) on the optimized "
                        "graph, for CPUs with AVX-512 VNNI or AMX; with --runtime openvino, "
                        "NNCF's static INT8 calibrated on --calibration; checked against the "
                        "torch backend")
    p.add_argument("--keep-float", default=None, metavar="ROLES",
                   help="with --quantize: weight roles left in FP32, comma-separated, from "
                        "qkv, attention-out, ffn-in, ffn-out, conv, head, or none "
                        "(default: head)")
    p.add_argument("--eval", type=paths.TASK_DATA, default=None, metavar="FILE",
                   help="score the export against the plain FP32 export on this file "
                        "(classification rows or SQuAD JSON): agreement and task metric")
    p.add_argument("--max-accuracy-drop", type=float, default=None, metavar="POINTS",
                   help="with --eval: refuse (write nothing, exit 2) if the export loses more "
                        "than POINTS of accuracy (SQuAD: F1)")
    p.set_defaults(handler=_cmd_export)

    p = sub.add_parser("import-hf", parents=[common],
                       help="convert a Hugging Face BERT directory into a popbert checkpoint",
                       description="Read config.json, model.safetensors or pytorch_model.bin "
                                   "(with or without the bert. prefix and heads) and vocab.txt; "
                                   "write a run directory usable as --checkpoint / --init-from.")
    p.add_argument("--model", type=paths.HF_MODEL, required=True, metavar="DIR")
    p.add_argument("--output-dir", "-o", type=paths.IMPORT_OUTPUT, required=True, metavar="DIR")
    p.add_argument("--sequence-length", type=int, default=None, metavar="N",
                   help="model.sequence_length of the written config (default: min(128, "
                        "max_position_embeddings))")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights initialised fresh (heads the checkpoint lacks)")
    p.set_defaults(handler=_cmd_import_hf)

    p = sub.add_parser("export-hf", parents=[common],
                       help="write a checkpoint as a Hugging Face model directory")
    p.add_argument("--checkpoint", type=paths.CHECKPOINT, required=True, metavar="DIR")
    p.add_argument("--output-dir", "-o", type=paths.HF_EXPORT_OUTPUT, required=True,
                   metavar="DIR")
    # Checked against the checkpoint's family (popbert.hf.mapping.architectures_of) once
    # the checkpoint is read: a class of another family is one line naming its family's.
    p.add_argument("--architecture", default=None, metavar="CLASS",
                   help="the transformers class to write, one of the checkpoint's family "
                        "(BertModel, BertForPreTraining, BertForMaskedLM, "
                        "BertForQuestionAnswering, BertForSequenceClassification, "
                        "BertForTokenClassification; ModernBertModel, ModernBertForMaskedLM, "
                        "ModernBertForQuestionAnswering, ModernBertForSequenceClassification, "
                        "ModernBertForTokenClassification); "
                        "default: the imported or fine-tuned model's class, else the one that "
                        "holds exactly the checkpoint's heads")
    p.set_defaults(handler=_cmd_export_hf)

    _add_serve_command(sub, common)

    p = sub.add_parser("config", parents=[common],
                       help="print (or save) the resolved, validated config")
    _add_config_args(p)
    p.add_argument("--output", "-o", type=paths.CONFIG_OUTPUT, default=None, metavar="FILE.yaml")
    p.set_defaults(handler=_cmd_config)

    p = sub.add_parser("plan", parents=[common],
                       help="memory and FLOPs per device and pipeline stage, without training",
                       description="From the annotated graph and the config alone: parameters, "
                                   "weights, gradients, optimizer state (with and without RTS), "
                                   "activations (with and without recompute) and training "
                                   "FLOPs per device and stage; whether it fits a device "
                                   "(exit status 1 when it does not).")
    _add_config_args(p)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--device", default=None, metavar="NAME",
                        help="check against a device: ipu-mk2, h100, a100-40gb, a100-80gb")
    target.add_argument("--memory-gb", type=float, default=None, metavar="X",
                        help="check against X GB (10^9 bytes) per device")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.set_defaults(handler=_cmd_plan)

    p = sub.add_parser("plot", parents=[common], help="plot a run's metrics, or overlay "
                       "several runs' curves labelled by what differs in their configs")
    p.add_argument("paths", type=paths.METRICS, nargs="+", metavar="RUN_DIR",
                   help="run directories (or their metrics.jsonl); one: its full plot; "
                        "several: their curves in one PNG")
    p.add_argument("--output", "-o", type=paths.PLOT_OUTPUT, default=None, metavar="FILE.png",
                   help="default: next to one run's metrics file, same name with .png; "
                        "compare.png for several runs")
    p.add_argument("--metric", action="append", default=[], metavar="KEY",
                   help="a metrics.jsonl key to compare (repeatable; default: loss and "
                        "the validation metrics)")
    p.set_defaults(handler=_cmd_plot)

    from popbert.cli.data import add_commands as add_data_commands

    add_data_commands(sub, common)  # prepare-data and its stages
    from popbert.cli.sweep import add_commands as add_sweep_commands

    add_sweep_commands(sub, common)  # sweep create | agent | run | show
    paths.declare_paths(parser)  # each command checks its path flags before it starts
    for _, command in paths.subparsers(parser):  # what a message may advise (tests check it)
        command.set_defaults(command_flags=frozenset(
            flag for action in command._actions for flag in action.option_strings))
    return parser


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command the CLI way: logging set up, a user error is one line on stderr and
    exit status 2 (a traceback means a bug), Ctrl-C is 130, a run stopped by SIGTERM or
    SIGUSR1 with its checkpoint 128 + the signal (143, 138: a job script requeues on it)."""
    _configure_logging(getattr(args, "verbose", False))
    try:
        _check_counts(args)
        paths.check_arguments(args)  # every declared path, before any work
        return int(handler(args))
    except KeyboardInterrupt as interrupt:
        # A run stopped by SIGTERM/SIGUSR1 after its checkpoint (popbert.train.loop.
        # RunInterrupted) says where and exits 128 + the signal, as if the signal had ended it.
        sys.stderr.write(f"popbert: {one_line(interrupt) if str(interrupt) else 'interrupted'}\n")
        return int(getattr(interrupt, "exit_status", 130))
    except Exception as exc:
        if isinstance(exc, _user_error_types()):
            sys.stderr.write(f"popbert: error: {one_line(exc)}\n")
            return 2
        if _out_of_memory(exc):
            sys.stderr.write(f"popbert: error: out of memory ({one_line(exc, 300)}): the run "
                             "needs more than this machine holds; make the model, the batch or "
                             "the data smaller (`popbert plan` estimates a config's memory)\n")
            return 2
        raise


def _check_counts(args: argparse.Namespace) -> None:
    """The flags every command that has them checks alike, before any work: `--threads`
    (torch's or the runtime's) within what any machine has, `--seed` what every generator
    takes."""
    for flag, rule in (("threads", PER_MACHINE), ("seed", SEED)):
        value = getattr(args, flag, None)
        if value is not None and not rule.allows(value):
            raise UsageError(f"--{flag} must be {rule.expected}, got {value}")


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: NumPy's and Python's MemoryError, torch's CPU allocator (a
    RuntimeError) and CUDA's OutOfMemoryError. The sizes come from the user's config, so it is
    said in one line with what to change, not as a traceback."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(oom, type) and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for user errors, with a one-line message)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help/--version (0)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run_command(args.handler, args)


__all__ = ["add_pretrain_arguments", "build_parser", "config_from_args",
           "finetune_config_from_args", "main", "pretrain_output_dir", "run_command"]
