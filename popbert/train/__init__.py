"""Making and running a run: `trainer` is the one door (`Trainer.from_config(cfg).train()`).

- `trainer`: `Trainer`, its `CheckpointManager` and `RunResult`;
- `jobs`: what a kind of run brings to the trainer (`Job`); `pretrain` and `finetune` fill it in
  (MLM/NSP pre-training; SQuAD and classification fine-tuning, `finetune_config`);
- `loop`: the one training loop (`train_loop`, `LoopSettings`, divergence and stop signals);
- `factories`: what a config turns into (optimizer, schedule, loss scaler, graph batch size).
"""
