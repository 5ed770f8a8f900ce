"""Running a lowered graph: sessions and what they are made of.

- :mod:`~popbert.runtime.options`: ``SessionOptions`` and ``SessionOptions.from_config``;
- :mod:`~popbert.runtime.devices`: the one device rule (``resolve_device``);
- :mod:`~popbert.runtime.session`: ``TrainingSession`` / ``InferenceSession``, the training step;
- :mod:`~popbert.runtime.inputs`: the checks a batch passes before it runs;
- :mod:`~popbert.runtime.partition`: the graph split into pipeline stages and recompute regions;
- :mod:`~popbert.runtime.schedules`: GPipe / 1F1B schedules and the ``PipelineEngine``;
- :mod:`~popbert.runtime.rng`: RNG states for checkpoints;
- :mod:`~popbert.runtime.buckets`: inference rows run longest first, each batch cut to its
  longest row (NumPy only: the torch-free predictors use it too).

Nothing is imported here: ``import popbert.runtime.options`` does not pay for the sessions.
"""
