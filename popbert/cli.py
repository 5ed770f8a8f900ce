"""The `popbert` command: pretrain, export, show a resolved config, plot metrics.

User mistakes (bad config, missing checkpoint, unusable data) end as one line
`popbert: error: <message>` on stderr with exit status 2, like argparse's own usage errors; a
traceback means a bug. Heavy modules (torch) are imported inside the handlers, so config errors
are reported in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from popbert import __version__
from popbert.errors import CheckpointError, PopbertError

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


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split()) or type(exc).__name__
    return message


def _existing_dir(path: Path | None, what: str) -> Path | None:
    if path is not None and not path.is_dir():
        raise CheckpointError(f"{what}: not a directory: {path}")
    return path


def _load(args: argparse.Namespace) -> RunConfig:
    from popbert.config import DEFAULT_PRESET, load_config

    config = args.config
    resume = getattr(args, "resume", None)
    if config is None and resume is not None and (resume / "config.yaml").is_file():
        # Resuming without --config continues with the config the run was started with.
        config = resume / "config.yaml"
    return load_config(config if config is not None else DEFAULT_PRESET, args.overrides)


def _cmd_pretrain(args: argparse.Namespace) -> int:
    resume = _existing_dir(args.resume, "--resume")
    init_from = _existing_dir(args.init_from, "--init-from")
    cfg = _load(args)
    output_dir = args.output_dir
    if output_dir is None:
        output_dir = Path("runs") / time.strftime("pretrain-%Y%m%d-%H%M%S")
    from popbert.pretrain import run_pretraining

    run_pretraining(cfg, output_dir=output_dir, resume=resume, init_from=init_from)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    checkpoint = _existing_dir(args.checkpoint, "--checkpoint")
    from popbert.export import export_checkpoint

    path = export_checkpoint(checkpoint=checkpoint, task=args.task, output=args.output)
    logger.info("wrote %s", path)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from popbert.config import dump_config, save_config

    cfg = _load(args)
    if args.output is not None:
        save_config(cfg, args.output)
        logger.info("wrote %s", args.output)
    else:
        sys.stdout.write(dump_config(cfg))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from popbert.plotting import plot_metrics

    output = args.output if args.output is not None else args.metrics.with_suffix(".png")
    path = plot_metrics(args.metrics, output)
    logger.info("wrote %s", path)
    return 0


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE_OR_PRESET", default=None,
                   help="YAML config file or preset name (tiny, base-128, base-384, large-128, "
                        "large-384); default: tiny")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append",
                   default=[], help="override one config value, in YAML syntax, e.g. "
                                    "--set optimizer.lr=1e-3 --set 'model.layers_per_ipu=[1,1]'")


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
    _add_config_args(p)
    p.add_argument("--output-dir", "-o", type=Path, default=None, metavar="DIR",
                   help="run directory (checkpoints, metrics); default runs/pretrain-<timestamp>")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", type=Path, default=None, metavar="DIR",
                       help="continue a run from its checkpoint (weights, optimizer, data "
                            "position, RNG)")
    start.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                       help="start a new run from a checkpoint's weights only (e.g. phase 2)")
    p.set_defaults(handler=_cmd_pretrain)

    p = sub.add_parser("export", parents=[common], help="export a checkpoint to inference ONNX")
    p.add_argument("--checkpoint", type=Path, required=True, metavar="DIR")
    p.add_argument("--task", choices=("pretraining", "encoder"), required=True,
                   help="pretraining: MLM + NSP heads; encoder: sequence output and pooler")
    p.add_argument("--output", type=Path, required=True, metavar="FILE.onnx")
    p.set_defaults(handler=_cmd_export)

    p = sub.add_parser("config", parents=[common],
                       help="print (or save) the resolved, validated config")
    _add_config_args(p)
    p.add_argument("--output", "-o", type=Path, default=None, metavar="FILE.yaml")
    p.set_defaults(handler=_cmd_config)

    p = sub.add_parser("plot", parents=[common], help="plot a run's metrics.jsonl to PNG")
    p.add_argument("metrics", type=Path, metavar="METRICS.jsonl")
    p.add_argument("--output", "-o", type=Path, default=None, metavar="FILE.png",
                   help="default: next to the metrics file, same name with .png")
    p.set_defaults(handler=_cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for user errors, with a one-line message)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help/--version (0)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _configure_logging(args.verbose)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        sys.stderr.write("popbert: interrupted\n")
        return 130
    except Exception as exc:
        if isinstance(exc, _user_error_types()):
            sys.stderr.write(f"popbert: error: {_one_line(exc)}\n")
            return 2
        raise


__all__ = ["build_parser", "main"]
