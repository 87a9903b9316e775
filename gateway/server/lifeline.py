"""A worker's lifeline to its supervisor: the workers of `sluice serve --workers N` exit when it dies, however.

uvicorn's supervisor starts the workers and stops them when it is told to; a supervisor that is killed
(SIGKILL, the OOM killer, a crash, a second signal during its own shutdown) tells them nothing, and they
would serve on, holding the port, for as long as anything keeps them busy. Two ties, armed once when a
worker builds its app:

- Linux's `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends the worker SIGTERM the moment its parent
  exits, which starts uvicorn's graceful stop at once;
- a watch thread, for every platform and for the case the first cannot cover: it waits on a pidfd of the
  supervisor (or polls the parent pid where there is none) and, once the supervisor is gone, sends the same
  SIGTERM and, `EXIT_AFTER_S` later, ends the process whatever it is doing, so that a graceful stop that
  waits on requests (`shutdown.grace_s` is 30 s by default) or a stuck one cannot keep an orphan alive.

The supervisor's pid comes in the environment (`handoff.SUPERVISOR`), set by `sluice serve` before it starts the
workers; a process without it (one worker, the tests, an embedding) arms nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time

from gateway import handoff

log = logging.getLogger("sluice")

EXIT_AFTER_S = 1.5  # from the supervisor's death to the worker's exit, at the latest
POLL_S = 0.2  # the parent-pid watch, where no pidfd can be had
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def arm() -> bool:
    """Tie this worker to the supervisor named in the environment; whether there was one to tie to."""
    text = os.environ.get(handoff.SUPERVISOR, "")
    if not text.isdigit():
        return False
    supervisor = int(text)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    threading.Thread(target=_watch, args=(supervisor,), name="sluice-lifeline", daemon=True).start()
    return True


def _watch(supervisor: int) -> None:
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(supervisor)
    # Checked after the pidfd is open: a supervisor that died before (its pid perhaps reused since) is no
    # longer this process's parent, and the pidfd, if any, names someone else.
    if pidfd is not None and os.getppid() == supervisor:
        select.select([pidfd], [], [])  # readable once the supervisor has exited
    else:
        while os.getppid() == supervisor:
            time.sleep(POLL_S)
    if pidfd is not None:
        os.close(pidfd)
    _orphaned(supervisor)


def _orphaned(supervisor: int) -> None:
    log.warning("supervisor %d is gone: worker %d stops within %g s", supervisor, os.getpid(), EXIT_AFTER_S)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop (already begun if PDEATHSIG came)
    time.sleep(EXIT_AFTER_S)
    os._exit(1)  # whatever still holds the process: nobody is left to stop it
