"""Data-parallel replicas on `torch.distributed`: joining the job, collectives, start-up checks.

One process per replica, started by `torchrun` (gloo on CPU, NCCL on GPU). Every replica holds the
whole model, reads its own share of each global batch and the gradients are mean-reduced, so N
replicas × A accumulation steps train exactly like 1 process × N·A accumulation steps. How the
gradients are reduced lives next door: flat all-reduced buffers
(:mod:`popbert.distributed.buffers`) or replicated tensor sharding
(:mod:`popbert.distributed.sharded`).

Every collective goes through :class:`Replicas`, which turns a failure (a replica died, or did not
answer within the timeout) into one :class:`ReplicaError` line instead of a hang. The line names
the replica that went away: each replica bumps a counter in the job's store every second
(:class:`Heartbeat`, a thread, so it keeps beating while its replica computes or writes), and
after a failure the counters that stand still are the culprits. A stopped process (SIGSTOP, a
hung node) keeps its sockets open, so only the timeout notices it; a killed one is noticed at once.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from popbert.errors import ConfigError, PopbertError, one_line

if TYPE_CHECKING:
    from popbert.config import RunConfig

log = logging.getLogger(__name__)

TIMEOUT_ENV = "POPBERT_REPLICA_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
# Rank r > 0 seeds dropout with seed + r * stride: distinct streams. (Stochastic rounding needs
# no per-rank seed: its bits hash the element's index in the whole tensor.)
SEED_STRIDE = 1_000_003


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
    heartbeat: Heartbeat | None = None  # names a silent replica after a failure

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
            silent = self.heartbeat.silent() if self.heartbeat is not None else None
            raise ReplicaError(
                f"replica {self.rank} of {self.size}: {what} failed ({cause}); "
                f"{_who(silent, 'died or did not answer')} within {self.timeout_s:g} s, so the "
                f"whole job stops (see {_whose(silent)} log; ${TIMEOUT_ENV} sets the timeout)"
            ) from None

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
            if self.heartbeat is not None:
                self.heartbeat.stop()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.owns_process_group = False
            gc.collect()  # drop the backend's last references while the interpreter is whole


def _short_cause(error: BaseException) -> str:
    """The gist of a backend error: no source location, first sentence, one line."""
    text = one_line(error)
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    first = text.split(". ")[0]
    return (first or type(error).__name__)[:200]


def _who(silent: list[int] | None, fate: str) -> str:
    """'replica 1 died ...', 'replicas 1, 3 died ...', or 'another replica died ...'."""
    if not silent:
        return f"another replica {fate}"
    if len(silent) == 1:
        return f"replica {silent[0]} {fate}"
    return f"replicas {', '.join(map(str, silent))} {fate}"


def _whose(silent: list[int] | None) -> str:
    return "its" if silent and len(silent) == 1 else "the other replicas'"


class Heartbeat:
    """This replica's pulse in the job's store: a daemon thread adds 1 to
    `popbert/heartbeat/<generation>/<rank>` every `interval` seconds, from before the
    process group is joined until shutdown. :meth:`silent` names the replicas whose count
    stands still: killed, stopped, or never started. The store is torchrun's agent store, or
    the one replica `store_host` (0) serves; when that replica is gone the store is too, and it
    is the one named.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, generation: str = "0",
                 interval: float = 1.0, store_host: int | None = None, announce: bool = False):
        self.host, self.port, self.rank, self.size = host, port, rank, size
        self.announce = announce  # replica 0 under torchrun: its join is open until joined()
        self.prefix = f"popbert/heartbeat/{generation}"
        self.interval = interval
        self.store_host = store_host
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._joining = True
        self._writer: Any = None  # the beating thread's client
        self._reader: Any = None  # silent()'s (the caller's thread)

    def _store(self) -> Any:
        # A client of its own (never shared between threads); short timeouts: a dead store
        # must not hold up the error message.
        return dist.PrefixStore(self.prefix, dist.TCPStore(
            self.host, self.port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self._wait)))

    @property
    def _wait(self) -> float:
        return max(0.5, 3 * self.interval)

    def _reachable(self) -> bool:
        """Whether the store still listens: a plain connect first, since torch prints a stack
        trace to stderr for every operation on a store that is gone."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self._wait):
                return True
        except OSError:
            return False

    def start(self) -> Heartbeat:
        """Connect (the store is up: the caller's client reached it) and beat from now on,
        ten times as often until :meth:`joined` (replica 0's pulse tells the others that its
        join is this attempt's, not a dead one's)."""
        self._writer, self._reader = self._store(), self._store()
        if self.announce:
            self._reader.set(_JOINING, "1")
        self._writer.add(str(self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="popbert-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def joined(self) -> None:
        """The process group is up: beat at the normal pace; replica 0 closes its join (a
        later join of this process, a sweep's next trial, must not be taken for it)."""
        self._joining = False
        if self.announce:
            with contextlib.suppress(Exception):
                self._reader.delete_key(_JOINING)

    def _beat(self) -> None:
        probed = time.monotonic()
        while not self._stop.wait(self.interval / 10 if self._joining else self.interval):
            try:
                if time.monotonic() - probed >= self.interval:  # a connection a second at most
                    probed = time.monotonic()
                    if not self._reachable():
                        return  # the store went with its host: nothing left to tell
                self._writer.add(str(self.rank), 1)
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._wait + 5)
            self._thread = None

    def silent(self) -> list[int] | None:
        """The other replicas whose count does not move within 3 intervals (None: unknown)."""
        others = [r for r in range(self.size) if r != self.rank]
        try:
            if self._reader is None or not self._reachable():
                raise ConnectionError("the store is gone")
            first = {r: self._reader.add(str(r), 0) for r in others}
            moved: set[int] = set()
            deadline = time.monotonic() + 3 * self.interval
            while time.monotonic() < deadline and len(moved) < len(others):
                time.sleep(self.interval / 4)
                moved |= {r for r in others
                          if r not in moved and self._reader.add(str(r), 0) != first[r]}
        except Exception:  # no store: its host is the one that went
            if self.store_host is not None and self.store_host != self.rank:
                return [self.store_host]
            return None
        return [r for r in others if r not in moved] or None


def heartbeat_interval(timeout: float) -> float:
    """Seconds between beats: 1, or a tenth of a shorter replica timeout."""
    return min(1.0, timeout / 10)


def _env_int(name: str, default: int) -> int:
    """An integer torchrun sets in the environment; a one-line error when it is not one."""
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer") from None


def world_size_from_env() -> int:
    """WORLD_SIZE as set by torchrun (1 when absent)."""
    return _env_int("WORLD_SIZE", 1)


def rank_from_env() -> int:
    """RANK as set by torchrun (0 when absent)."""
    return _env_int("RANK", 0)


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


def init_replicas(cfg: RunConfig, device: torch.device) -> Replicas:
    """Join the job torchrun started (env:// rendezvous), checked against the config.

    ``device`` is the run's resolved device (``popbert.runtime.devices.resolve_device`` of
    ``execution.device``): gloo on CPU, NCCL on CUDA; each replica's first CUDA device is
    ``LOCAL_RANK × devices_per_replica`` (as ``SessionOptions.from_config`` places it). A single
    process without torchrun gets :meth:`Replicas.single` and touches nothing of
    torch.distributed.
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
    use_cuda = torch.device(device).type == "cuda"
    kwargs: dict[str, Any] = {}
    if use_cuda:
        first = (torch.device(device).index or 0) + local_rank * devices_per_replica(cfg)
        if first >= torch.cuda.device_count():
            raise ConfigError(
                f"replica {rank} (local rank {local_rank}) needs cuda:{first} but this node has "
                f"{torch.cuda.device_count()} GPU(s): start fewer processes per node")
        torch.cuda.set_device(first)
        kwargs["device_id"] = torch.device("cuda", first)
    backend = "nccl" if use_cuda else "gloo"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    heartbeat = None
    try:
        store, heartbeat = _job_store(rank, world, timeout, agent_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
    except (RuntimeError, ValueError, dist.DistError) as error:
        if heartbeat is not None:
            silent = heartbeat.silent()
            heartbeat.stop()
        else:  # no store or no join of replica 0's to take part in
            silent = None if rank == 0 else [0]
        missing = f"; {_who(silent, 'did not join')} within {timeout:g} s" if silent else ""
        raise ReplicaError(f"replica {rank} of {world} could not join the job "
                           f"({one_line(error, 240)}){missing} (${TIMEOUT_ENV} sets the "
                           "timeout)") from None
    heartbeat.joined()
    log.info("replica %d of %d (local rank %d) joined, backend %s", rank, world, local_rank,
             backend)
    return Replicas(group=None, rank=rank, size=world, local_rank=local_rank, timeout_s=timeout,
                    owns_process_group=True, heartbeat=heartbeat)


_JOINS = itertools.count()  # this process's joins so far: every replica makes the same ones


def _job_store(rank: int, world: int, timeout: float, agent_store: bool
               ) -> tuple[Any, Heartbeat]:
    """The store the replicas meet in, and this replica's heartbeat there (started).

    Without torchrun's shared store, replica 0 serves a new one, as env:// does, but made here,
    without waiting for the others, so the heartbeats can start before the join.

    Under torchrun it is the agents' shared store (`$TORCHELASTIC_USE_AGENT_STORE`), which
    outlives a restart of the workers, and torch's env:// join reads it unprefixed: a restarted
    replica would find the dead attempt's addresses (gloo then fails to connect, or hangs;
    torch issue 135712). `$TORCHELASTIC_RESTART_COUNT` cannot tell the attempts apart, as each
    machine counts only its own failures, so every join gets a generation of its own in the
    store (:func:`_join_generation`) and its keys live under it.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    interval = heartbeat_interval(timeout)
    store = dist.TCPStore(host, port, world, is_master=not agent_store and rank == 0,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
                          multi_tenant=True)
    if not agent_store:
        generation = f"local-{next(_JOINS)}"
    elif rank == 0:
        generation = f"g{store.add(_GENERATION_KEY, 1)}"
    else:
        generation = _join_generation(store, timeout, interval)
    heartbeat = Heartbeat(host, port, rank, world, generation, interval,
                          store_host=None if agent_store else 0,
                          announce=agent_store and rank == 0).start()
    if agent_store and rank == 0:  # beating already: the others can tell it is alive
        store.set(_CURRENT_KEY, generation)
    return dist.PrefixStore(f"popbert/join/{generation}", store), heartbeat


_GENERATION_KEY = "popbert/generation"  # joins of replica 0 so far, in torchrun's store
_CURRENT_KEY = "popbert/current"  # the newest one's generation
_JOINING = "joining"  # under a generation's heartbeats: replica 0 has not joined yet


def _join_generation(store: Any, timeout: float, interval: float) -> str:
    """The generation of the join replica 0 of this attempt opened: the newest one, still
    open (a finished join, e.g. a sweep's previous trial, is closed) and with a heartbeat that
    moves (a dead attempt's stands still; the new replica 0 then publishes its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not store.check([_CURRENT_KEY]):
            time.sleep(interval / 10)
            continue
        generation = store.get(_CURRENT_KEY).decode()
        beats = dist.PrefixStore(f"popbert/heartbeat/{generation}", store)
        first = beats.add("0", 0)
        alive_by = time.monotonic() + 3 * interval
        while time.monotonic() < min(alive_by, deadline) and beats.check([_JOINING]):
            time.sleep(interval / 20)
            if beats.add("0", 0) != first:
                return generation
            if store.get(_CURRENT_KEY).decode() != generation:
                break  # a newer join opened meanwhile
        else:
            time.sleep(interval / 10)  # closed or dead: wait for the next one
    raise RuntimeError(f"replica 0 did not open a join within {timeout:g} s")


def agree(replicas: Replicas, what: str, value: Any) -> None:
    """Raise ReplicaError unless every replica passes the same ``value`` (e.g. start step)."""
    values = replicas.all_gather_object(value)
    if any(v != values[0] for v in values):
        raise ReplicaError(f"replicas disagree on {what}: {values}")


def replica_seed(seed: int, rank: int) -> int:
    """Dropout seed of replica ``rank`` (rank 0 keeps ``seed``: 1-process runs are unchanged)."""
    return seed + SEED_STRIDE * rank if rank else seed

