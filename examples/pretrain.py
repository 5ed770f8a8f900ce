"""The main job, one step at a time: config → data → graph → session → loop → checkpoint → export.

    python examples/pretrain.py                              # tiny BERT, bundled corpus, CPU
    python examples/pretrain.py --config base-128 --set execution.device=cuda
    python examples/pretrain.py --resume runs/my-run         # continue a stopped run, in place

It takes the flags of `popbert pretrain` and does the same job in one process;
`popbert pretrain` (`popbert.train.pretrain.run_pretraining`) adds torchrun replicas.
"""

import sys
import time
from argparse import ArgumentParser
from pathlib import Path

import torch

import popbert
from popbert.atomic import atomic_write_bytes, atomic_write_text
from popbert.cli.main import add_pretrain_arguments, config_from_args, run_command
from popbert.config import dump_config
from popbert.data.pretraining import (
    load_training_data,
    load_validation_data,
    make_loader,
    validation_batches,
)
from popbert.io import checkpoint, run_dir
from popbert.io.export import export_weights
from popbert.observe.tracking import MetricsLogger
from popbert.optimizers import set_lr
from popbert.train import factories, pretrain
from popbert.train.loop import save_final, train_loop


def main(args) -> int:
    # 1. Config: a preset (tiny unless --config says otherwise) under --set overrides, checked.
    cfg = config_from_args(args)
    pretrain.check_supported(cfg)
    out = args.output_dir or (run_dir.run_dir_of(args.resume) if args.resume
                              else Path("runs") / time.strftime("pretrain-%Y%m%d-%H%M%S"))
    run_dir.check_output_dir(out)

    # 2. Data: the bundled Wikipedia slice masked into MLM/NSP instances (or your HDF5 shards).
    loader = make_loader(cfg, load_training_data(cfg))
    validation = validation_batches(cfg, load_validation_data(cfg))  # held out: training.eval_every

    # 3. Graph: BERT emitted op by op; every node carries its device and pipeline stage.
    torch.manual_seed(cfg.training.seed)
    graph = popbert.build_bert(cfg.model, seed=cfg.training.seed,
                               batch_size=factories.graph_batch_size(cfg))

    # 4. Session: the graph lowered to torch, trained with our LAMB / AdamW.
    session = popbert.TrainingSession(graph.model(), graph.loss,
                                      factories.optimizer_factory(cfg),
                                      popbert.SessionOptions.from_config(cfg),
                                      loss_scaler=factories.loss_scaler(cfg))
    schedule = factories.lr_schedule(cfg)
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    if args.resume:
        pretrain.restore(session, loader, checkpoint.load_checkpoint(args.resume))
    elif args.init_from:
        start = checkpoint.load_checkpoint(args.init_from, weights_only=True)
        session.load_weights(pretrain.matching_weights(start.weights, session), strict=False)

    # 5. Loop: progress bar, metrics.jsonl, a checkpoint every training.checkpoint_every steps.
    run_dir.create_output_dir(out)
    run_dir.clean_interrupted(out)
    config_yaml = dump_config(cfg)
    model = graph.model()
    atomic_write_text(out / "config.yaml", config_yaml)
    atomic_write_bytes(out / "model.onnx", model.SerializeToString())  # open it in Netron
    saving = pretrain.checkpointing_for(cfg, out, session, loader, config_yaml, model)
    with MetricsLogger(out, cfg.to_dict(), resume_step=session.step if args.resume else None
                       ) as metrics:
        try:
            train_loop(session, pretrain.batches(loader, session.micro_batches_per_run()),
                       steps=cfg.training.steps, log_every=cfg.training.log_every,
                       schedule=schedule, tracker=metrics,
                       samples_per_step=cfg.global_batch_size, checkpointing=saving,
                       divergence_factor=cfg.training.divergence_factor, desc="pretrain",
                       validation=validation, eval_every=cfg.training.eval_every)
        finally:
            metrics.close()
            pretrain.plot_if_logged(out / "metrics.jsonl", out / "metrics.png")

    # 6. Checkpoint and export: the final state, and an inference ONNX checked in ONNX Runtime.
    final = save_final(session, saving)
    export_weights(session.weights(), cfg.model, "pretraining", out / "model.inference.onnx")
    print(f"done: {out} (checkpoint {final.name}, model.inference.onnx, metrics.png)")
    return 0


if __name__ == "__main__":
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", "-v", action="store_true")
    add_pretrain_arguments(parser)
    sys.exit(run_command(main, parser.parse_args()))
