"""Child-process hygiene: exit when the parent dies, so no server process is ever orphaned."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def watch_parent(poll_interval_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that kills this process when its parent process goes away, and make SIGTERM
    (the parent's orderly shutdown) a normal exit.

    Polling ``os.getppid()`` works on every POSIX platform (prctl's PDEATHSIG is Linux-only and
    fires on the parent *thread*'s exit). Call it first thing in every child process entry.
    SIGTERM's default action ends the process without running exit handlers, so multiprocessing
    semaphores it created (tqdm's write lock, Inductor's compile pool) stayed registered, and the
    resource tracker warned about "leaked semaphore objects" at every Engine shutdown.
    """
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent_pid = os.getppid()

    def _loop() -> None:
        while True:
            time.sleep(poll_interval_s)
            if os.getppid() != parent_pid:
                logger.error("parent process %d exited; process %d exits too", parent_pid, os.getpid())
                os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=_loop, name="sglite-parent-watchdog", daemon=True)
    thread.start()
    return thread
