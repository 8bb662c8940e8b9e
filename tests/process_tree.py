"""A launcher's process tree, for the tests that kill one (torchrun, accelerate, a node): its
descendants read from /proc, and SIGKILL to each, as a machine that dies would leave them."""

import os
import signal


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first. torchrun starts each worker in a session of its own,
    so killing the launcher's process group would not reach them: they are found one by one."""
    children = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # it exited (and was reaped) while we walked the tree
        return []
    for task in tasks:
        try:
            children += [int(child) for child in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except FileNotFoundError:
            pass
    return [grandchild for child in children for grandchild in [child, *descendants(child)]]


def kill_all(pids) -> None:
    """SIGKILL each of ``pids`` that still runs."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it."""
    kill_all([*descendants(pid), pid])
