"""A launched process ends with its launcher, within a fraction of a second, whatever it is doing.

torchrun starts each worker in a session of its own, and accelerate's ``notebook_launcher`` forks
them, so a launcher killed hard (``kill -9``, the out-of-memory killer, a preempted job) takes no
worker with it: the workers sleep and retry against a store that is gone, each holding its memory (a
GPU's, on a GPU) and the output's lock, for ever. Every worker therefore watches the process that
started it, and when that process is gone it kills itself with SIGKILL: its files are left as a
kill of the whole job at that moment leaves them (appended lines are whole and fsynced, a
checkpoint is written to a temporary folder and renamed, the output's lock is an ``flock`` the
kernel releases), which is what the same command, run again, resumes from.

Two ways a process knows its launcher:

- Under torchrun, ``accelerate launch`` or ``notebook_launcher`` (``LOCAL_RANK`` is set) the launcher
  is the parent. The kernel is asked to send SIGKILL when it dies (``PR_SET_PDEATHSIG``, Linux; it
  fires when the thread that started the worker ends, and each of those launchers starts its workers
  from the thread that then waits for them), and a thread polls ``getppid`` as well.
- A process the workbook starts and waits for (the pilot's fresh-process probe, the benchmark's steps,
  the forecast check's jobs) is given ``WORKBOOK_LAUNCHER_PID`` by ``child_environment``, which its
  own children inherit; it ends when that process does, even when it is not its parent (a worker of a
  torchrun that the benchmark started watches both).

``workbook/__init__.py`` calls ``end_with_launcher`` when a launched process first imports the
package, a few hundredths of a second after it starts rather than after the seconds its imports of
torch and transformers take; the worker entries that a fork reaches without an import
(``notebook_launcher``'s) call it again. Both calls are cheap and idempotent per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

LAUNCHER_VARIABLE = "WORKBOOK_LAUNCHER_PID"  # "<pid>:<start time in clock ticks>" of the launching process
POLL_SECONDS = 0.2  # how often the watching thread looks; the kernel's death signal needs no polling
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_watching_in_pid: int | None = None  # the process that started the watching thread (a fork has no thread)


def child_environment(environment: dict | None = None) -> dict:
    """``environment`` (default: this process's) naming this process as the launcher of the child that
    is started with it, so the child ends if this process dies before it."""
    launcher = f"{os.getpid()}:{_start_ticks(os.getpid())}"
    return {**(os.environ if environment is None else environment), LAUNCHER_VARIABLE: launcher}


def end_with_launcher() -> None:
    """Watch this process's launcher, if it has one, and end this process (SIGKILL) as soon as the
    launcher is gone; at once if it already is. A process nobody launched is left alone."""
    global _watching_in_pid
    if _watching_in_pid == os.getpid() or not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if "LOCAL_RANK" in os.environ else None
    named = _named_launcher()
    if parent is None and named is None:
        return
    if parent == 1 and not _first_process_is_a_launcher():
        _end()  # the launcher died before this process could look (it was reparented to init)
    if parent is not None and parent != 1:
        _ask_kernel_for_death_signal()
        if os.getppid() != parent:  # it died between the two calls: no signal will come
            _end()
    if named is not None and not _alive(*named):
        _end()
    _watching_in_pid = os.getpid()
    threading.Thread(target=_watch, args=(parent if parent != 1 else None, named), name="launcher-watch",
                     daemon=True).start()


def _watch(parent: int | None, named: tuple[int, int | None] | None) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if (parent is not None and os.getppid() != parent) or (named is not None and not _alive(*named)):
            _end()


def _end() -> None:
    """Stop as a SIGKILL at this moment would: no handler, no flush, no teardown that could wait on peers."""
    os.kill(os.getpid(), signal.SIGKILL)


def _ask_kernel_for_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl (not glibc): the polling thread still watches


def _named_launcher() -> tuple[int, int | None] | None:
    """(pid, start ticks) from ``WORKBOOK_LAUNCHER_PID``; None when unset, malformed or this process's own."""
    pid_text, _, ticks_text = os.environ.get(LAUNCHER_VARIABLE, "").partition(":")
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return None
    return int(pid_text), int(ticks_text) if ticks_text.isdigit() else None


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat): with the pid, it
    names one process even after the pid is reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start_ticks: int | None) -> bool:
    """Whether that process runs: a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and (start_ticks is None or int(fields[19]) == start_ticks)


def _first_process_is_a_launcher() -> bool:
    """Whether pid 1 is itself the launcher (torchrun or accelerate as a container's first process), so
    that a parent of 1 means a live launcher, not one that died. A container's init is not Python."""
    try:
        arguments = Path("/proc/1/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    names = [Path(argument.decode(errors="replace")).name for argument in arguments[:3]]
    return any(name.startswith("python") or name in ("torchrun", "accelerate") for name in names)
