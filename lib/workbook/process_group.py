"""The processes of one launch and their process group: how long one waits for the others at the
group's start and at each exchange, and which of them is missing when it stops waiting.

A process whose peer died on the same machine hears of it at once (its sockets close); one whose
peer's machine stopped answering, or whose peer hangs, waits at the next exchange for as long as
the process group's timeout: ``peer_timeout_seconds`` (torch's own defaults are 30 minutes for
gloo, 10 for NCCL). Either way the error torch raises names an address, or nothing. So each process
of a launch counts a heartbeat in the launch's store (the launcher's under torchrun and accelerate,
``MASTER_ADDR:MASTER_PORT``) from a thread of its own, and a process whose exchange failed reads
the counts twice: a peer whose count stood still is the missing one, named by its rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import os
import threading
import time

HEARTBEAT_SECONDS = 0.5  # how often each process counts its heartbeat in the store
STILL_SECONDS = 4.0  # a count that did not move over this long is a missing process (eight beats)
STORE_SECONDS = 10.0  # a store that does not answer in this long is itself gone
# gloo's worker threads free a collective's work after its wait has returned; see leave_group.
GLOO_SETTLE_SECONDS = 0.2

_beating_in_pid: int | None = None


def init_options(timeout_seconds: float) -> dict:
    """The keywords of ``init_process_group`` (accelerate's ``PartialState`` and
    ``InitProcessGroupKwargs`` pass them on) that bound every wait for the other processes."""
    return {"timeout": dt.timedelta(seconds=timeout_seconds)}


def _launch() -> tuple[str, int, int, int, str] | None:
    """(store host, port, rank, world size, key prefix) of this launched process; None when alone."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    if world < 2:
        return None
    # torchrun keeps its store over a restart of the workers: a restart's heartbeats start afresh.
    prefix = (f"workbook/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return host, port, rank, world, prefix


def _client(host: str, port: int, seconds: float):
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=seconds), wait_for_workers=False)


def start_heartbeat() -> None:
    """Count this process's heartbeat in the launch's store every HEARTBEAT_SECONDS, from a daemon
    thread, until the process ends (no-op when alone, idempotent). The store may not be up yet (under
    ``notebook_launcher`` the first process opens it as it joins the group): the thread keeps trying."""
    global _beating_in_pid
    launch = _launch()
    if launch is None or _beating_in_pid == os.getpid():
        return
    _beating_in_pid = os.getpid()
    host, port, rank, _, prefix = launch

    stop = threading.Event()

    def beat() -> None:
        store = None
        while not stop.is_set():
            try:
                store = store or _client(host, port, STORE_SECONDS)
                store.add(f"{prefix}/{rank}", 1)
            except Exception:  # the store is not up yet, or gone: the exchange that needs it will say so
                store = None
            stop.wait(HEARTBEAT_SECONDS)

    thread = threading.Thread(target=beat, name="process-group-heartbeat", daemon=True)
    thread.start()

    def stop_beating() -> None:
        # Stopped before the interpreter finalizes: a daemon thread coming back from torch's C++ (the
        # store call) after that is ended by pthread_exit through C++ frames, which can abort the exit
        # ("terminate called without an active exception"). So the wait outlasts the longest beat, a store
        # call that times out, not only the pause between beats: on a loaded machine a call can take seconds.
        stop.set()
        thread.join(timeout=STORE_SECONDS + HEARTBEAT_SECONDS)

    atexit.register(stop_beating)


def leave_group() -> None:
    """Leave the process group once this process has nothing more to exchange: a barrier, so that no
    process tears down while a peer still finishes the last exchange (without it, 5 of 43 two-process
    tensor-parallel CPU runs aborted at exit; none of 40 with it), then the group destroyed. On gloo,
    a pause follows with the GIL released. Its worker threads free each finished collective's work (and
    the tensors it holds) after the wait for it has returned; a tensor whose Python object died first
    needs the GIL to be freed. A process that exits at once finalizes the interpreter before that, the
    worker thread is ended inside C++ code and the process aborts ("terminate called without an active
    exception", SIGABRT) after its work is done: 3 in 152 two-process tensor-parallel runs on torch 2.11
    here before the pause, none in 200 after it."""
    import torch.distributed as dist
    gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if gloo:
        time.sleep(GLOO_SETTLE_SECONDS)


def missing_peers() -> tuple[list[int], str]:
    """(the other ranks whose heartbeat stood still over STILL_SECONDS, a sentence about the launch's
    store when it does not answer itself, else '')."""
    launch = _launch()
    if launch is None:
        return [], ""
    host, port, rank, world, prefix = launch
    try:
        store = _client(host, port, STORE_SECONDS)
        before = [store.add(f"{prefix}/{peer}", 0) for peer in range(world)]
        time.sleep(STILL_SECONDS)
        after = [store.add(f"{prefix}/{peer}", 0) for peer in range(world)]
    except Exception as error:
        holder = ("the launcher of the first node" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                  else "process 0")
        return [], (f"the launch's store at {host}:{port}, which {holder} holds, does not answer either "
                    f"({type(error).__name__}): {holder} is gone")
    return [peer for peer in range(world) if peer != rank and after[peer] == before[peer]], ""


def is_exchange_failure(error: BaseException) -> bool:
    """An error of this process's process group (gloo, NCCL, its store), not of the job's own work: no
    retry on a smaller batch can help it, since the peer it needs is gone or silent."""
    import torch.distributed as dist
    if not dist.is_available():
        return False
    if isinstance(error, dist.DistError):  # the store's and the backends' own errors, the group's start included
        return True
    if not dist.is_initialized():  # no group: a RuntimeError saying "Timed out" is the job's own
        return False
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        sign in text for sign in ("gloo", "Gloo", "NCCL", "Timed out", "Connection closed by peer",
                                  "Connection reset by peer", "pair closure", "Broken pipe"))


@contextlib.contextmanager
def peers_named(error_class: type[Exception], timeout_seconds: float):
    """Run a launched process's work; an exchange with the other processes that fails (a peer gone, or
    silent for ``timeout_seconds``) becomes ``error_class`` naming the missing rank(s)."""
    start_heartbeat()
    try:
        yield
    except Exception as error:
        launch = _launch()
        if launch is None or not is_exchange_failure(error):
            raise
        missing, store_gone = missing_peers()
        if not missing and not store_gone:
            raise
        rank, world = launch[2], launch[3]
        who = (f"rank {', '.join(map(str, missing))} of {world} stopped answering (its process ended or hangs, or its "
               "machine cannot be reached)" if missing else store_gone)
        raise error_class(
            f"rank {rank} of {world} stopped: {who}; an exchange with it failed, or waited longer than "
            f"peer_timeout_seconds ({timeout_seconds:g} s; raise it for a slow network). Its own output says why it "
            f"stopped; the same command run again resumes what was written. ({_first_line(error)})"
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
