"""Data-parallel replicas on `torch.distributed`, and replicated tensor sharding (RTS).

One process per replica, started by `torchrun` (gloo on CPU, NCCL on GPU). Every replica holds the
whole model, reads its own share of each global batch and the gradients are mean-reduced, so N
replicas × A accumulation steps train exactly like 1 process × N·A accumulation steps.

Without RTS (:class:`GradientBuffer`) each parameter's ``.grad`` is a view into one flat buffer,
all-reduced once per optimizer step, and every replica runs the ordinary optimizer on the whole
model (identical state everywhere).

With RTS (:class:`ShardedOptimizer`) the trainable weights live in one flat buffer per
(device, dtype), padded to a multiple of N. Replica r owns the r-th 1/N slice. After every
micro-batch its flat gradient is reduce-scattered and added to an FP32 shard accumulator, so each
replica holds 1/N of the accumulated gradient and 1/N of the FP32 Adam moments. The update runs on
the shard with :mod:`popbert.optimizers.functional`; LAMB's per-tensor norms are partial sums over
the pieces of each tensor that the shard holds, completed by one small all-reduce. The updated
shard is rounded to the weight dtype (stochastically for half weights) and all-gathered into the
flat weight buffer, in the weight dtype. Checkpoints hold the gathered, unsharded optimizer state
in the ordinary optimizer's format, so they load with or without RTS and on any replica count.

Every collective goes through :class:`Replicas`, which turns a failure (a replica died, or did not
answer within the timeout) into one :class:`ReplicaError` line instead of a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from popbert.errors import ConfigError, PopbertError
from popbert.optimizers import functional as F
from popbert.optimizers.optimizer import AdamFamilyOptimizer
from popbert.optimizers.stochastic_rounding import round_to_dtype

if TYPE_CHECKING:
    from popbert.config import RunConfig

log = logging.getLogger(__name__)

TIMEOUT_ENV = "POPBERT_REPLICA_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
# Rank r > 0 seeds dropout and its rounding generator with seed + r * stride: distinct streams.
SEED_STRIDE = 1_000_003
_ALIGN = 16  # elements between parameters in flat buffers are aligned to


class ReplicaError(PopbertError):
    """A replica died or stopped answering: the whole job stops (never hangs)."""


def replica_timeout() -> float:
    """Seconds a collective may wait for the other replicas ($POPBERT_REPLICA_TIMEOUT, 600)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"${TIMEOUT_ENV} must be > 0 seconds, got {raw!r}")
    return value


@dataclass
class Replicas:
    """The replicas of a data-parallel job and the collectives between them.

    ``group=None`` with ``size == 1`` is a single process: every collective is a no-op. A job
    may also run in a sub-group of a larger world (tests, notebooks); ranks here are group ranks.
    """

    group: Any = None
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    owns_process_group: bool = False

    @classmethod
    def single(cls) -> Replicas:
        return cls()

    @classmethod
    def from_group(cls, group: Any = None, local_rank: int | None = None,
                   owns_process_group: bool = False) -> Replicas:
        """The replicas of an initialised process group (None: the default group);
        ``owns_process_group``: :meth:`shutdown` tears torch.distributed down."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        return cls(group=group, rank=rank, size=size, local_rank=local,
                   timeout_s=replica_timeout(), owns_process_group=owns_process_group)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes every output (config, metrics, checkpoints, export, plot)."""
        return self.rank == 0

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as error:
            cause = _short_cause(error)
            raise ReplicaError(
                f"replica {self.rank} of {self.size}: {what} failed ({cause}); another replica "
                f"died or did not answer within {self.timeout_s:.0f} s, so the whole job stops "
                f"(see the other replicas' logs; ${TIMEOUT_ENV} sets the timeout)") from None

    def all_reduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In place: sum / max over replicas."""
        if self.size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                         "min": dist.ReduceOp.MIN}[op]
            with self._collective(f"all-reduce of {tuple(tensor.shape)}"):
                dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def reduce_scatter(self, output: Tensor, flat: Tensor) -> Tensor:
        """``output`` = this replica's 1/N slice of the sum of ``flat`` over replicas."""
        if self.size == 1:
            return output.copy_(flat)
        with self._collective(f"reduce-scatter of {flat.numel()} values"):
            dist.reduce_scatter_single(output, flat, group=self.group)
        return output

    def all_gather(self, flat: Tensor, shard: Tensor) -> Tensor:
        """``flat`` = the concatenation of every replica's ``shard`` (in rank order)."""
        if self.size == 1:
            return flat.copy_(shard)
        with self._collective(f"all-gather of {flat.numel()} values"):
            dist.all_gather_single(flat, shard, group=self.group)
        return flat

    def broadcast_(self, tensor: Tensor, src: int = 0) -> Tensor:
        """In place: every replica gets replica ``src``'s ``tensor``."""
        if self.size > 1:
            with self._collective("broadcast"):
                dist.broadcast(tensor, src=dist.get_global_rank(self.group, src)
                               if self.group is not None else src, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every replica's picklable ``obj``, in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        with self._collective("all-gather of python objects"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            with self._collective("barrier"):
                dist.barrier(group=self.group)

    def shutdown(self, clean: bool = True) -> None:
        """Tear down the process group this object created (a no-op otherwise).

        ``clean``: the job finished on every replica, so all pass a barrier first and none
        destroys its group while another is still inside a collective (gloo worker threads
        that outlive their group can abort the interpreter at exit). After an error there is
        no barrier: a peer may be blocked in another collective.
        """
        if self.owns_process_group and dist.is_initialized():
            if clean:
                self.barrier()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.owns_process_group = False
            gc.collect()  # drop the backend's last references while the interpreter is whole


def _short_cause(error: BaseException) -> str:
    """The gist of a backend error: no source location, first sentence, one line."""
    text = " ".join(str(error).split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    first = text.split(". ")[0]
    return (first or type(error).__name__)[:200]


def world_size_from_env() -> int:
    """WORLD_SIZE as set by torchrun (1 when absent)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"$WORLD_SIZE={raw!r} is not an integer") from None


def check_world_size(cfg: RunConfig, world: int) -> None:
    """The job's process count must equal execution.replicas: one process per replica."""
    e = cfg.execution
    batch = (f"global batch {cfg.global_batch_size} = execution.micro_batch_size "
             f"{e.micro_batch_size} x execution.replicas {e.replicas} x "
             f"execution.gradient_accumulation {e.gradient_accumulation}")
    if world == e.replicas:
        return
    if world == 1:
        raise ConfigError(
            f"execution.replicas is {e.replicas} ({batch}) but this is a single process: start "
            f"one process per replica, e.g. `torchrun --nproc-per-node {e.replicas} -m popbert "
            "pretrain ...`")
    per_step = e.micro_batch_size * world
    hint = ""
    if cfg.global_batch_size % per_step == 0:
        hint = (f"; to keep the global batch set execution.replicas={world} and "
                f"execution.gradient_accumulation={cfg.global_batch_size // per_step}")
    raise ConfigError(f"execution.replicas is {e.replicas} ({batch}) but the job has {world} "
                      f"processes (WORLD_SIZE={world}){hint}")


def devices_per_replica(cfg: RunConfig) -> int:
    """Devices one replica spans: the pipeline's device count, else 1."""
    if cfg.execution.pipeline and cfg.model.layers_per_ipu:
        return len(cfg.model.layers_per_ipu)
    return 1


def init_replicas(cfg: RunConfig) -> Replicas:
    """Join the job torchrun started (env:// rendezvous), checked against the config.

    gloo on CPU, NCCL on CUDA; each replica's first CUDA device is
    ``LOCAL_RANK × devices_per_replica``. A single process without torchrun gets
    :meth:`Replicas.single` and touches nothing of torch.distributed.
    """
    world = world_size_from_env()
    check_world_size(cfg, world)
    if world == 1:
        return Replicas.single()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but ${', $'.join(missing)} unset: start the job "
                          "with torchrun (which sets them)")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    timeout = replica_timeout()
    if dist.is_initialized():  # the caller set up the default group itself
        if dist.get_world_size() != world:
            raise ConfigError(f"torch.distributed already runs {dist.get_world_size()} "
                              f"processes, but WORLD_SIZE={world}")
        return Replicas.from_group(None, local_rank)
    device = cfg.execution.device
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    kwargs: dict[str, Any] = {}
    if use_cuda:
        first = local_rank * devices_per_replica(cfg)
        if first >= torch.cuda.device_count():
            raise ConfigError(
                f"replica {rank} (local rank {local_rank}) needs cuda:{first} but this node has "
                f"{torch.cuda.device_count()} GPU(s): start fewer processes per node")
        torch.cuda.set_device(first)
        kwargs["device_id"] = torch.device("cuda", first)
    backend = "nccl" if use_cuda else "gloo"
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, ValueError, dist.DistError) as error:
        raise ReplicaError(f"replica {rank} of {world} could not join the job "
                           f"({' '.join(str(error).split())[:240]})") from None
    log.info("replica %d of %d (local rank %d) joined, backend %s", rank, world, local_rank,
             backend)
    return Replicas(group=None, rank=rank, size=world, local_rank=local_rank, timeout_s=timeout,
                    owns_process_group=True)


# ---------------------------------------------------------------------------------------------
# Flat buffers
# ---------------------------------------------------------------------------------------------


@dataclass
class _Space:
    """Parameters of one (device, dtype), laid out back to back in one flat buffer."""

    device: torch.device
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int = 0
    grads: Tensor = field(default_factory=lambda: torch.empty(0))


def _spaces(params: Sequence[torch.nn.Parameter], multiple: int) -> list[_Space]:
    by_key: dict[tuple[str, torch.dtype], _Space] = {}
    for p in params:
        key = (str(p.device), p.dtype)
        space = by_key.get(key)
        if space is None:
            space = by_key[key] = _Space(p.device, p.dtype, [], [], 0)
        space.params.append(p)
        # 64-byte aligned, like separate allocations: kernels vectorise (and round) the same.
        space.numel = -(-space.numel // _ALIGN) * _ALIGN
        space.offsets.append(space.numel)
        space.numel += p.numel()
    for space in by_key.values():
        space.padded = -(-space.numel // multiple) * multiple
    return list(by_key.values())


def _attach_grad_views(space: _Space) -> None:
    """Point each parameter's ``.grad`` at its slice of the space's flat gradient buffer."""
    for p, offset in zip(space.params, space.offsets):
        view = space.grads[offset:offset + p.numel()].view(p.shape)
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            p.grad = view


def flatten_parameters(space: _Space) -> Tensor:
    """Move the space's parameters into one flat buffer; each ``p.data`` becomes a view of it."""
    flat = torch.zeros(space.padded, dtype=space.dtype, device=space.device)
    for p, offset in zip(space.params, space.offsets):
        view = flat[offset:offset + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view
    return flat


def broadcast_parameters(params: Sequence[torch.nn.Parameter], replicas: Replicas) -> None:
    """Make every replica start from replica 0's weights (one broadcast per device/dtype)."""
    if not replicas.distributed:
        return
    with torch.no_grad():
        for space in _spaces(params, 1):
            flat = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
            views = [flat[offset:offset + p.numel()].view(p.shape)
                     for p, offset in zip(space.params, space.offsets)]
            torch._foreach_copy_(views, [p.detach() for p in space.params])
            replicas.broadcast_(flat)
            torch._foreach_copy_([p.detach() for p in space.params], views)


class GradientBuffer:
    """Data parallelism without sharding: one flat gradient per device/dtype, mean-all-reduced.

    Each parameter's ``.grad`` is a view into the flat buffer, so backward accumulates straight
    into it and one all-reduce per step (not one per tensor) synchronises the replicas.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], replicas: Replicas):
        self.replicas = replicas
        self.spaces = _spaces(params, 1)
        for space in self.spaces:
            space.grads = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
            _attach_grad_views(space)

    def zero_(self) -> None:
        """Start a step: zero the flat buffers (and re-attach views a caller may have dropped)."""
        for space in self.spaces:
            space.grads.zero_()
            _attach_grad_views(space)

    def all_reduce_mean_(self) -> None:
        """Mean of the gradients over the replicas, in place."""
        for space in self.spaces:
            self.replicas.all_reduce_(space.grads)
            space.grads.div_(self.replicas.size)


# ---------------------------------------------------------------------------------------------
# Replicated tensor sharding
# ---------------------------------------------------------------------------------------------


@dataclass
class _Piece:
    """The part of parameter ``index`` that lies in this replica's shard of a space."""

    index: int
    param_offset: int
    length: int
    shard_offset: int
    shape: tuple[int, ...]  # the parameter's
    whole: bool  # the piece is the whole parameter


@dataclass
class _ShardSpace:
    space: _Space
    weights: Tensor  # the flat weight buffer (weight dtype), parameters are views of it
    shard_size: int
    pieces: list[_Piece]
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad_acc: Tensor  # FP32 accumulated gradient shard (sum over replicas, not yet / N)
    scatter: Tensor  # reduce-scatter output in the gradient dtype

    def shard(self, rank: int) -> Tensor:
        return self.weights[rank * self.shard_size:(rank + 1) * self.shard_size]

    def view(self, flat_shard: Tensor, piece: _Piece) -> Tensor:
        """A piece of a shard-sized tensor; shaped like its parameter when it holds all of it
        (so reductions over it round exactly as the unsharded optimizer's do)."""
        part = flat_shard[piece.shard_offset:piece.shard_offset + piece.length]
        return part.view(piece.shape) if piece.whole else part


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of FP32 optimizer state (Adam moments) this replica holds."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                total += value.numel() * value.element_size()
    return total


class ShardedOptimizer:
    """LAMB / AdamW with optimizer state and accumulated gradient sharded over the replicas.

    Wraps a :class:`~popbert.optimizers.AdamFamilyOptimizer` that only supplies the parameter
    groups and hyper-parameters (it never allocates state), so learning-rate schedules keep
    setting ``param_groups[i]["lr"]`` and checkpoints keep its ``state_dict`` format.
    Call :meth:`accumulate` after each backward pass, then :meth:`step`.
    """

    def __init__(self, base: AdamFamilyOptimizer, replicas: Replicas):
        if not isinstance(base, AdamFamilyOptimizer):
            raise TypeError("replicated tensor sharding needs popbert's Lamb or AdamW optimizer, "
                            f"got {type(base).__name__}")
        self.base = base
        self.replicas = replicas
        self.param_groups = base.param_groups
        self.params: list[torch.nn.Parameter] = [p for g in base.param_groups for p in g["params"]]
        self.group_of: list[int] = [i for i, g in enumerate(base.param_groups)
                                    for _ in g["params"]]
        self.steps: list[int] = [0] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._accumulated = 0
        rank, size = replicas.rank, replicas.size
        self.shards: list[_ShardSpace] = []
        for space in _spaces(self.params, size):
            weights = flatten_parameters(space)
            shard_size = space.padded // size
            lo, hi = rank * shard_size, (rank + 1) * shard_size
            pieces = []
            for p, offset in zip(space.params, space.offsets):
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start < end:
                    pieces.append(_Piece(self._index[id(p)], start - offset, end - start,
                                         start - lo, tuple(p.shape),
                                         end - start == p.numel()))
            space.grads = torch.zeros(space.padded, dtype=space.dtype, device=space.device)
            _attach_grad_views(space)
            fp32 = dict(dtype=torch.float32, device=space.device)
            self.shards.append(_ShardSpace(
                space, weights, shard_size, pieces, torch.zeros(shard_size, **fp32),
                torch.zeros(shard_size, **fp32), torch.zeros(shard_size, **fp32),
                torch.zeros(shard_size if size > 1 else 0, dtype=space.dtype,
                            device=space.device)))
        self._generators: dict[str, torch.Generator] = {}
        log.info("replicated tensor sharding: replica %d holds %d of %d optimizer values",
                 rank, sum(s.shard_size for s in self.shards),
                 sum(s.space.numel for s in self.shards))

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        return self.base.max_grad_norm

    def state_bytes(self) -> int:
        """Bytes of this replica's FP32 Adam moments (its 1/N share)."""
        return sum(2 * s.shard_size * 4 for s in self.shards)

    def gradient_shard_bytes(self) -> int:
        """Bytes of this replica's FP32 accumulated-gradient shard."""
        return sum(s.shard_size * 4 for s in self.shards)

    def _seed(self) -> int:
        return self.base._seed + SEED_STRIDE * self.replicas.rank

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed())
            self._generators[key] = gen
        return gen

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (the views stay attached; ``set_to_none`` ignored)."""
        del set_to_none
        for shard in self.shards:
            shard.space.grads.zero_()
            _attach_grad_views(shard.space)

    # -- gradients -----------------------------------------------------------------------------
    @torch.no_grad()
    def accumulate(self) -> None:
        """Reduce-scatter the gradients of the last backward pass(es) into the FP32 shard."""
        for shard in self.shards:
            space = shard.space
            if self.replicas.size == 1:
                part = space.grads
            else:
                part = self.replicas.reduce_scatter(shard.scatter, space.grads)
            if self._accumulated == 0:
                shard.grad_acc.copy_(part)
            else:
                shard.grad_acc.add_(part)
            space.grads.zero_()
        self._accumulated += 1

    def found_inf(self) -> bool:
        """Whether any replica's gradient shard holds inf/NaN (one scalar all-reduce)."""
        bad = torch.zeros(1, dtype=torch.float32, device=self._norm_device())
        for shard in self.shards:
            bad += (~torch.isfinite(shard.grad_acc)).sum().to(bad.device, torch.float32)
        return bool(self.replicas.all_reduce_(bad).item() > 0)

    # -- the update ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: float | None = None) -> None:
        """One optimizer step on this replica's shard, then all-gather the weights.

        The arithmetic is the optimizer package's own (``functional.lamb_step_`` /
        ``adamw_step_``) on this replica's pieces of each tensor; LAMB's squared norms are
        completed by an all-reduce of one small ``[2, tensors]`` vector per parameter group.
        """
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        if self._accumulated == 0:
            raise RuntimeError("ShardedOptimizer.step without accumulate(): no gradients")
        if grad_scale is not None and not grad_scale > 0:
            raise ValueError(f"grad_scale must be positive, got {grad_scale}")
        # grad_acc holds the sum over replicas: the mean is folded into the gradient factor.
        factor = 1.0 / self.replicas.size / (1.0 if grad_scale is None else grad_scale)
        if self.max_grad_norm is not None:
            # Summed as the unsharded optimizer sums them (per device in FP32), then over
            # the replicas.
            partial = sum(float(F.per_tensor_sq_norms(
                [shard.view(shard.grad_acc, p) for p in shard.pieces]).sum())
                for shard in self.shards)
            sq = torch.tensor([partial], dtype=torch.float64, device=self._norm_device())
            total = float(self.replicas.all_reduce_(sq).item()) * factor**2
            factor *= F.clip_coefficient(total, self.max_grad_norm)
        for i in range(len(self.params)):
            self.steps[i] += 1

        for shard in self.shards:
            space = shard.space
            mine = shard.shard(self.replicas.rank)
            device = space.device

            def reduce(sq: Tensor, device: torch.device = device) -> Tensor:
                return self.replicas.all_reduce_(sq.to(device)).to(sq.device)

            for group_index, group in enumerate(self.param_groups):
                # Every replica calls every trust-ratio group, holding pieces or not: the norm
                # all-reduce inside is a collective.
                pieces = [p for p in shard.pieces if self.group_of[p.index] == group_index]
                if not pieces and not group["trust_ratio"]:
                    continue
                common = dict(
                    lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    bias_correction=group["bias_correction"], grad_factor=factor,
                    tile_numel=self.base._tile_numel(device),
                    round_fn=self._round_fn(group, space))
                lists = ([shard.view(mine, p) for p in pieces],
                         [shard.view(shard.grad_acc, p) for p in pieces],
                         [shard.view(shard.exp_avg, p) for p in pieces],
                         [shard.view(shard.exp_avg_sq, p) for p in pieces],
                         [self.steps[p.index] for p in pieces])
                if group["trust_ratio"]:
                    F.lamb_step_(*lists, max_trust_ratio=group["max_trust_ratio"],
                                 max_weight_norm=group["max_weight_norm"],
                                 tensor_index=[p.index for p in pieces],
                                 num_tensors=len(self.params), reduce_sq_norms=reduce, **common)
                else:
                    F.adamw_step_(*lists, **common)
            self.replicas.all_gather(shard.weights, mine.clone())
        self._accumulated = 0

    def _round_fn(self, group: dict[str, Any], space: _Space) -> Any:
        """Rounding of updated half weights: stochastic with this replica's generator."""
        if space.dtype == torch.float32:
            return None
        stochastic = group["stochastic_rounding"]
        stochastic = True if stochastic is None else bool(stochastic)
        gen = self._generator(space.device) if stochastic else None

        def round_fn(x: Tensor, dtype: torch.dtype) -> Tensor:
            return round_to_dtype(x, dtype, stochastic, gen)

        return round_fn

    def _norm_device(self) -> torch.device:
        return self.shards[0].grad_acc.device if self.shards else torch.device("cpu")

    # -- checkpoints (the unsharded optimizer's format) ----------------------------------------
    def _gathered(self, shard: _ShardSpace, local: Tensor) -> Tensor:
        full = torch.empty(shard.space.padded, dtype=local.dtype, device=local.device)
        return self.replicas.all_gather(full, local)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, gathered from every replica (a collective: all call it)."""
        sd = self.base.state_dict()  # param groups and seed; the base holds no moments
        state: dict[int, dict[str, Any]] = {}
        for shard in self.shards:
            moments = {"exp_avg": self._gathered(shard, shard.exp_avg).cpu(),
                       "exp_avg_sq": self._gathered(shard, shard.exp_avg_sq).cpu()}
            for p, offset in zip(shard.space.params, shard.space.offsets):
                i = self._index[id(p)]
                if self.steps[i] == 0:
                    continue
                entry: dict[str, Any] = {"step": self.steps[i]}
                for key, full in moments.items():
                    entry[key] = full[offset:offset + p.numel()].view(p.shape).clone()
                state[i] = entry
        sd["state"] = state
        generators = {key: gen.get_state() for key, gen in self._generators.items()}
        rng = dict(sd.get("popbert_rng", {}))
        rng["replica_generators"] = self.replicas.all_gather_object(generators)
        if rng["replica_generators"][0]:
            rng["generators"] = rng["replica_generators"][0]
        sd["popbert_rng"] = rng
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded or gathered state dict: keep this replica's slice of every moment."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("optimizer state has different parameter groups than this model")
        rng = dict(state_dict.get("popbert_rng") or {})
        replica_generators = rng.pop("replica_generators", None)
        base_sd = {"state": {}, "param_groups": saved_groups}
        if rng:
            base_sd["popbert_rng"] = rng
        self.base.load_state_dict(base_sd)
        self.param_groups = self.base.param_groups
        saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
        position = {key: i for i, key in enumerate(saved_ids)}
        entries = {position[k]: v for k, v in state_dict["state"].items() if k in position}
        self.steps = [int(entries[i]["step"]) if i in entries else 0
                      for i in range(len(self.params))]
        for shard in self.shards:
            shard.exp_avg.zero_()
            shard.exp_avg_sq.zero_()
            for piece in shard.pieces:
                entry = entries.get(piece.index)
                if entry is None:
                    continue
                p = self.params[piece.index]
                for key, target in (("exp_avg", shard.exp_avg), ("exp_avg_sq", shard.exp_avg_sq)):
                    value = entry[key]
                    if tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"optimizer state {key} of parameter {piece.index} has "
                                         f"shape {tuple(value.shape)}, the model "
                                         f"{tuple(p.shape)}")
                    flat = value.reshape(-1)[piece.param_offset:piece.param_offset + piece.length]
                    target[piece.shard_offset:piece.shard_offset + piece.length].copy_(flat)
        self._generators = {}
        if replica_generators is not None and len(replica_generators) == self.replicas.size:
            for key, gen_state in replica_generators[self.replicas.rank].items():
                gen = torch.Generator(device=key)
                gen.set_state(gen_state.clone())
                self._generators[key] = gen
        elif self.replicas.size == 1 and self.base._generators:
            self._generators = dict(self.base._generators)
        elif any(s.space.dtype != torch.float32 for s in self.shards):
            log.info("replica count changed: stochastic-rounding generators restart from the seed")
        self._accumulated = 0


def agree(replicas: Replicas, what: str, value: Any) -> None:
    """Raise ReplicaError unless every replica passes the same ``value`` (e.g. start step)."""
    values = replicas.all_gather_object(value)
    if any(v != values[0] for v in values):
        raise ReplicaError(f"replicas disagree on {what}: {values}")


def replica_seed(seed: int, rank: int) -> int:
    """Dropout seed of replica ``rank`` (rank 0 keeps ``seed``: 1-process runs are unchanged)."""
    return seed + SEED_STRIDE * rank if rank else seed

