"""The replicas' heartbeats in the job's store: after a failed collective they name the replica
that went silent (no processes: heartbeats of one process, one of them stopped)."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from replica_helpers import free_port

from popbert.distributed.replicas import Heartbeat, _who


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
