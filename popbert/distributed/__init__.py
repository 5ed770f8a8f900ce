"""Scale-out over processes: replicas under torchrun, flat gradient buffers, sharded optimizer
state, and the gradient-synchronisation strategy a training step runs with.

- :mod:`~popbert.distributed.replicas`: joining the job, collectives, start-up checks;
- :mod:`~popbert.distributed.elastic`: a torchrun restart resumes its own run by itself;
- :mod:`~popbert.distributed.buffers`: flat parameter/gradient buffers, the all-reduced one;
- :mod:`~popbert.distributed.sharded`: replicated tensor sharding (RTS) of the optimizer;
- :mod:`~popbert.distributed.gradients`: local / all-reduce / sharded step strategies.
"""

from popbert.distributed.buffers import GradientBuffer, broadcast_parameters, flatten_parameters
from popbert.distributed.gradients import (
    AllReduceGradients,
    GradientSync,
    LocalGradients,
    ShardedGradients,
    gradient_sync,
)
from popbert.distributed.replicas import (
    SEED_STRIDE,
    ReplicaError,
    Replicas,
    agree,
    check_world_size,
    devices_per_replica,
    init_replicas,
    rank_from_env,
    replica_seed,
    replica_timeout,
    world_size_from_env,
)
from popbert.distributed.sharded import ShardedOptimizer

__all__ = [
    "SEED_STRIDE",
    "AllReduceGradients",
    "GradientBuffer",
    "GradientSync",
    "LocalGradients",
    "ReplicaError",
    "Replicas",
    "ShardedGradients",
    "ShardedOptimizer",
    "agree",
    "broadcast_parameters",
    "check_world_size",
    "devices_per_replica",
    "flatten_parameters",
    "gradient_sync",
    "init_replicas",
    "replica_seed",
    "replica_timeout",
    "rank_from_env",
    "world_size_from_env",
]
