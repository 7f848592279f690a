"""`comm.free_port`: the port it picks is free, lies below the kernel's ephemeral range (where
the kernel's own picks for port-0 binds and outgoing connections never land) and below SGLang's
range for its own later-bound ports, and does not follow the seed of Python's `random` (a trainer
seeds it; every process would pick the same ports)."""

import random
import socket

from megatron_gspo.comm import ABOVE_PICKED, LOWEST_PICKED, bindable, ephemeral_range, free_port


def test_picked_ports_are_free_and_below_the_ephemeral_range():
    low, high = ephemeral_range()
    assert 0 < low <= high <= 65535
    for _ in range(20):
        port = free_port()
        if min(low, ABOVE_PICKED) - LOWEST_PICKED >= 1000:
            assert LOWEST_PICKED <= port < min(low, ABOVE_PICKED)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: this bind does not raise


def test_a_port_held_by_a_listener_is_not_bindable():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not bindable(taken)
    assert bindable(free_port())


def test_picks_do_not_follow_the_seed_of_random():
    picks = set()
    for _ in range(8):
        random.seed(0)
        picks.add(free_port())
    assert len(picks) > 1
