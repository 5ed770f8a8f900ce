"""The replicas' heartbeats in the job's store: after a failed collective they name the replica
that went silent, and under torchrun they tell a restarted replica which join is alive (no
processes: heartbeats of one process, one of them stopped)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist
from replica_helpers import free_port

from popbert.distributed.replicas import (
    _CURRENT_KEY,
    _JOINING,
    Heartbeat,
    _join_generation,
    _who,
)


def test_the_silent_replica_is_named() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    beats = [Heartbeat("127.0.0.1", port, rank, 3, interval=0.1, store_host=0).start()
             for rank in range(3)]
    try:
        beats[2].stop()  # replica 2 stops answering (killed, or SIGSTOPped)
        assert beats[0].silent() == [2]
        assert beats[1].silent() == [2]
        beats[1].stop()
        assert beats[0].silent() == [1, 2]
    finally:
        for beat in beats:
            beat.stop()
    del server  # the store's host went: the replicas it served name it
    assert beats[1].silent() == [0]
    assert Heartbeat("127.0.0.1", port, 0, 3, interval=0.1).silent() is None  # never started


def test_the_message_names_one_several_or_another() -> None:
    assert _who([1], "died") == "replica 1 died"
    assert _who([1, 3], "died") == "replicas 1, 3 died"
    assert _who(None, "died") == _who([], "died") == "another replica died"


def test_a_restarted_replica_joins_the_live_attempt_not_a_dead_one() -> None:
    """Under torchrun's shared store the replicas meet under the generation replica 0 opened:
    a dead attempt's (its heartbeat stands still) and a finished join's (closed: a sweep's
    previous trial) are passed over."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    # A dead attempt: its replica 0 opened g1, then died (the heartbeat stands still).
    dead = dist.PrefixStore("popbert/heartbeat/g1", store)
    dead.set(_JOINING, "1")
    dead.add("0", 5)
    store.set(_CURRENT_KEY, "g1")
    with pytest.raises(RuntimeError, match="replica 0 did not open a join within 0.5 s"):
        _join_generation(store, timeout=0.5, interval=0.05)

    def replica_zero(generation: str) -> Heartbeat:
        beat = Heartbeat("127.0.0.1", port, 0, 2, generation, interval=0.05,
                         announce=True).start()
        store.set(_CURRENT_KEY, generation)
        return beat

    later = threading.Timer(0.2, lambda: beats.append(replica_zero("g2")))
    beats: list[Heartbeat] = []
    later.start()
    try:
        assert _join_generation(store, timeout=5, interval=0.05) == "g2"
        later.join()
        beats[0].joined()  # the join is done: it closes, while its heartbeat goes on
        with pytest.raises(RuntimeError):
            _join_generation(store, timeout=0.5, interval=0.05)
    finally:
        later.cancel()
        for beat in beats:
            beat.stop()
