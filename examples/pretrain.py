"""The main job: pre-train a BERT from a config, with a progress bar, a loss plot, a checkpoint and
an ONNX export.

    python examples/pretrain.py                              # tiny BERT, bundled corpus, CPU
    python examples/pretrain.py --config base-128 --set execution.device=cuda
    python examples/pretrain.py --resume runs/my-run         # continue a stopped run, in place
    torchrun --nproc-per-node 2 --max-restarts 3 examples/pretrain.py --set execution.replicas=2

It takes the flags of `popbert pretrain` and makes the same run: `popbert.Trainer` is the one
door both go through (config → graph → session → steps → checkpoint → export).
"""

import argparse
import logging
import sys

import popbert
from popbert.cli.main import add_pretrain_arguments
from popbert.errors import PopbertError, one_line
from popbert.io.paths import check_arguments, declared_paths


def main(args: argparse.Namespace) -> int:
    # The config: a preset (tiny unless --config says otherwise; a resumed run's own config)
    # under --set overrides, checked.
    resumed = args.resume / "config.yaml" if args.resume else None
    config = args.config or (resumed if resumed and resumed.is_file() else "tiny")
    cfg = popbert.load_config(config, args.overrides)

    # The run: the annotated BERT graph, a session training it with our LAMB, the bundled
    # Wikipedia slice masked into MLM/NSP batches, checkpoints and metrics in the run directory.
    # The run directory is this run's alone: locked while it runs; one holding another run is
    # refused unless --overwrite deletes that run first. Under torchrun --max-restarts, a
    # restarted job finds its run again and resumes it by itself.
    with popbert.Trainer.from_config(cfg, args.output_dir, resume=args.resume,
                                     init_from=args.init_from,
                                     overwrite=args.overwrite) as trainer:
        result = trainer.train()  # then the final checkpoint, metrics.png, model.inference.onnx

    if result.inference_model is not None:  # under torchrun, replica 0 writes the outputs
        print(f"done: {result.output_dir} (checkpoint {result.checkpoint.name}, "
              f"loss {result.final_metrics['loss']:.3f}, {result.inference_model.name})")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    add_pretrain_arguments(parser)  # --config, --set, -o, --resume, --init-from, --overwrite
    arguments = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("popbert").setLevel(logging.DEBUG if arguments.verbose else logging.INFO)
    try:
        check_arguments(arguments, declared_paths(parser))  # each path flag, before any work
        sys.exit(main(arguments))
    except PopbertError as error:  # a user's mistake: one line, exit status 2
        print(f"popbert: error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as stop:  # Ctrl-C; or SIGTERM/SIGUSR1, after a checkpoint
        print(f"popbert: {stop or 'interrupted'}", file=sys.stderr)
        sys.exit(getattr(stop, "exit_status", 130))
