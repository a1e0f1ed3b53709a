"""The trackers (logger=mlflow, logger=wandb) in a process of their own, which rank 0 starts and feeds.

MLflow's start is seconds of Python: its import and its SQLAlchemy store. On a thread of rank 0 it held
Python's lock (the GIL) against the loop's own Python for all that time, so the ranks waited for rank 0
even where a core stood idle. In a process of its own it runs on a core of its own: rank 0 only queues
each call, and a thread hands them over a socket.

`python -m ddp.reporting.tracker_process FD` is that process: it opens the trackers, makes the calls in
their order, and sends its log records back to rank 0, whose handlers (console, run log) write them.
It runs in a session of its own, out of reach of the signals sent to rank 0's process group (torchrun's
SIGTERM when a rank fails, a terminal's Ctrl-C), and ignores from its start the signals that SLURM and
submitit send to every process of a job (SIGTERM, the requeue's SIGUSR1 or SIGUSR2): rank 0 stops at
its step boundary and then ends the tracker runs through it. Should rank 0 die without ending them,
its socket closes and this process exits at once, as a thread of rank 0 would have died with it: the
journal (trackers.PointJournal) covers the points it missed.
"""

import contextlib
import gc
import logging
import logging.handlers
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from socket import socketpair
from typing import Any

from ddp.reporting.rank_zero import call_each, one_line

log = logging.getLogger("train")

REPO = Path(__file__).resolve().parents[2]  # so that the process imports this `ddp`, installed or not
IGNORED_SIGNALS = "HUP INT QUIT TERM USR1 USR2"  # a terminal's, SLURM's, submitit's; the process ends with rank 0's socket


class TrackerProcess:
    """The trackers in a process of their own, to RankZeroWriter one tracker: each call is queued and
    returns at once. A thread starts the process, sends it what opens the trackers (`opening()`: the logger
    config, the TrackedRun, the journal's earlier points; computed on that thread), then the calls, in
    their order; another writes the process's log records through this process's handlers. `close` waits
    until everything queued is sent and the runs are ended."""

    name = "trackers"

    def __init__(self, opening: Callable[[], tuple]):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.connection, theirs = (Connection(end.detach()) for end in socketpair())
        # daemons: should the writer never be closed, rank 0 still exits, and the process with it
        self.sender = threading.Thread(target=self._send, args=(opening, theirs), name="trackers", daemon=True)
        self.receiver = threading.Thread(target=self._receive, name="tracker-logs", daemon=True)
        self.process: subprocess.Popen | None = None
        self.sender.start()

    def _send(self, opening: Callable[[], tuple], theirs: Connection) -> None:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        # the signals that would end it ignored from its first instruction (an ignored signal stays ignored across
        # exec, and Python leaves it so): it ends when rank 0 closes its socket; and a session of its own
        command = ["/bin/sh", "-c", f'trap "" {IGNORED_SIGNALS}; exec "$@"', "sh", sys.executable, "-m", __name__, str(theirs.fileno())]
        with theirs:
            try:
                self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=os.environ | {"PYTHONPATH": path},
                                                start_new_session=True)
            except OSError as error:
                log.warning("the trackers' process failed to start (%s): the run goes on without them", one_line(error))
                return
        self.receiver.start()
        try:
            call = ("open", (*opening(), sys.argv))
        except BaseException:  # the process is told to end (else rank 0's close would wait for it), and the error goes on
            with contextlib.suppress(OSError):
                self.connection.send(("close", (True,)))
            raise
        try:
            while call[0] != "close":
                self.connection.send(call)
                call = self.calls.get()
            self.connection.send(call)
        except OSError as error:  # the process is gone (killed)
            log.warning("the trackers' process ended early (%s): they log nothing more; the run and its files go on",
                        one_line(error))

    def _receive(self) -> None:
        """The process's log records, until its None that says the runs are ended (or until it is gone)."""
        with contextlib.suppress(EOFError, OSError):
            while (record := self.connection.recv()) is not None:
                logging.getLogger(record.name).handle(record)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.put(("add_scalar", (tag, float(value), step)))

    def commit(self) -> None:
        self.calls.put(("commit", ()))

    def add_image(self, tag: str, image, step: int) -> None:
        """`image`: H x W x 3 bytes, a numpy array (RankZeroWriter's): a tensor would import torch in the process."""
        self.calls.put(("add_image", (tag, image, step)))

    def add_params(self, params: dict[str, Any]) -> None:
        self.calls.put(("add_params", (dict(params),)))

    def close(self, failed: bool) -> None:
        """Returns once the runs are ended; the process's own exit (its imports' teardown, most of a second
        with MLflow) goes on beside the rest of the run's end."""
        self.calls.put(("close", (failed,)))
        self.sender.join()
        if self.process is not None:
            self.receiver.join()
        self.connection.close()


class _ToRankZero(logging.handlers.QueueHandler):
    """This process's log records, sent to rank 0, prepared as QueueHandler prepares them (the message
    formatted, the traceback as text). Handler.handle holds the handler's lock around each send."""

    def enqueue(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):  # rank 0 is gone: nothing to tell
            self.queue.send(record)


def main(fd: int) -> None:
    # The trackers' opening leaves 430,000 objects (MLflow's import and store) that live as long as the process.
    # Python's cyclic garbage collector scanned them again and again as they came (0.5 s of the opening's 2.2 s
    # of CPU) and once more at the exit (0.7 s), on cores that the ranks use: it waits until the trackers are open,
    # and then leaves what they made (gc.freeze) to the collections of what comes later
    gc.disable()
    from ddp.reporting.trackers import open_trackers

    connection = Connection(fd)
    logging.getLogger().handlers = [_ToRankZero(connection)]
    logging.getLogger().setLevel(logging.INFO)
    try:
        call, args = connection.recv()
        if call != "open":
            return
        logger_cfg, run, earlier_points, sys.argv = args  # argv: what the trackers record as the program, the training's
        trackers = open_trackers(logger_cfg, run, earlier_points)
        gc.freeze()
        gc.enable()
        while call != "close":
            call, args = connection.recv()
            call_each(trackers, call, *args)
        connection.send(None)  # the runs are ended: rank 0 goes on
        # and may end before this process's own exit (most of a second), which so keeps none of its console's pipes open
        for stream in (1, 2):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream)
    except EOFError:  # rank 0 died without ending the runs: so does this process, at once, as a thread of it would
        os._exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
