"""DataLoader workers that a rank can start safely, that outlive a stop signal to the rank's process
group, that end with the rank, and that reuse the memory their samples free."""

import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import select
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import DataLoader, Dataset, get_worker_info

from ddp.distributed.env import keep_freed_host_memory


# Workers are forked by a fork server, a single-threaded process that the rank starts once, never by
# the rank itself. A rank runs threads (gloo's, TensorBoard's writer), and a fork copies any lock
# that one of them holds at that moment: forked from the rank, a validation worker hung inside
# os.fork about once in 20 two-rank runs under load, right after a collective, and its rank waited
# for it forever.
#
# torchrun stops a rank with a signal to the rank's whole process group (SIGTERM, or SIGINT when it
# got a Ctrl-C), and a terminal sends Ctrl-C to its whole foreground group. A loader worker that died
# of it would fail the rank before it saves its checkpoint. So the server starts with both signals
# blocked and keeps them so; workers, forked with them blocked, leave the group, drop any that reached
# them before that, and only then take signals again. A worker's parent is the server, which lives as
# long as any worker does, so a worker watches the rank itself and exits when it is gone.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_POSIX = hasattr(signal, "pthread_sigmask")
_FORK_SERVER = "forkserver" in multiprocessing.get_all_start_methods()


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    if not _POSIX:
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # a signal meanwhile is delivered now


def start_worker_server(dataset: Dataset, num_workers: int):
    """Start the fork server (once; call early, so that its imports overlap the rank's set-up) and
    return its context, or None without workers.

    A worker imports the main script, as multiprocessing does. The server imports torch, the main
    script as a module (multiprocessing means to, by default, but Python 3.11 never passes it the
    script's path), the dataset's module and its `worker_modules` if it has any, so that a worker
    starts in milliseconds, not seconds.
    """
    if num_workers == 0 or not _FORK_SERVER:
        return None
    main_script = getattr(sys.modules["__main__"], "__file__", None)
    # and what the dataset says its workers need (data=hf: `datasets`, a second or more to import)
    return start_fork_server(["torch", type(dataset).__module__, *getattr(dataset, "worker_modules", ()),
                              *([Path(main_script).stem] if main_script else [])])


def start_fork_server(preload: list[str]):
    """Start this process's fork server, importing the modules `preload` names, and return its
    context. Only the first call starts it: later calls get the same server, with its first preload."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    multiprocessing.resource_tracker.ensure_running()  # first: starting it unblocks the stop signals
    with _stop_signals_blocked():
        multiprocessing.forkserver.ensure_running()
    return context


def _init_worker(worker_id: int, rank_pid: int) -> None:
    normalization = getattr(get_worker_info().dataset, "image_normalization", None)
    if normalization is not None:  # images leave as uint8, and the rank normalizes them on the device (to_device)
        normalization.deferred = True
    keep_freed_host_memory()  # fresh from the fork server, a worker gave a batch's freed images back and took them again
    if not _POSIX:
        return
    os.setpgid(0, 0)
    while signal.sigtimedwait(_STOP_SIGNALS, 0) is not None:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if hasattr(os, "pidfd_open"):
        threading.Thread(target=_exit_with, args=(rank_pid,), daemon=True).start()


def _exit_with(rank_pid: int) -> None:
    try:
        rank = os.pidfd_open(rank_pid)
    except ProcessLookupError:
        os._exit(0)
    select.select([rank], [], [])  # readable once the rank has exited
    os._exit(0)


class WorkerSafeDataLoader(DataLoader):
    """A DataLoader whose workers come from the fork server, outlive a SIGTERM or SIGINT to the
    rank's process group, and end with the rank (see above). A dataset's images whose transform ends
    in its `image_normalization` come out of the workers as uint8: move batches with that
    normalization (ddp/loading/batches.py's to_device)."""

    def __init__(self, dataset: Dataset, num_workers: int, **kwargs):
        super().__init__(dataset, num_workers=num_workers, multiprocessing_context=start_worker_server(dataset, num_workers),
                         worker_init_fn=functools.partial(_init_worker, rank_pid=os.getpid()), **kwargs)

    def __iter__(self):
        with _stop_signals_blocked():  # workers start inside, inheriting the blocked signals
            iterator = super().__iter__()
        if self.num_workers > 0:
            _iterators_with_workers.add(iterator)
        return iterator


# Every iterator of a WorkerSafeDataLoader in this process that started workers (see shut_down_workers).
_iterators_with_workers: "weakref.WeakSet" = weakref.WeakSet()


def shut_down_workers() -> None:
    """Shut down the workers of every loader iterator still alive in this process and wait for them,
    through torch's own shutdown (the one an exhausted or collected iterator runs). For a rank about
    to exit with its loader still referenced, as a stop's exception holds the loop's frames.

    Left to the interpreter's exit, torch skips its shutdown, and multiprocessing unlinks the queues'
    named semaphores and only then terminates the workers. A worker still starting (under load, seconds
    after the first batch; it blocks the stop signals until it has started) then fails to open its
    queues and prints a FileNotFoundError traceback under the stop's message. Shut down here instead,
    a starting worker finishes starting, finds the shutdown and exits."""
    for iterator in list(_iterators_with_workers):
        iterator._shutdown_workers()
