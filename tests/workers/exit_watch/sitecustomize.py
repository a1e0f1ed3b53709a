"""With this folder on PYTHONPATH, every Python process imports this module as it starts (the site
module does) and, when its atexit handlers run (main has returned, the interpreter is about to
finalize), writes the names of its threads to $WATCH_DIR/threads_<pid>.json, with its RANK and
argv. A gloo process group still alive then shows as its worker threads, `pt_gloo_runloop`."""

import atexit
import json
import os
import sys
from pathlib import Path


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sorted(names)


def record_threads() -> None:
    record = {"rank": os.environ.get("RANK"), "argv": sys.argv, "threads": thread_names()}
    Path(os.environ["WATCH_DIR"], f"threads_{os.getpid()}.json").write_text(json.dumps(record))


atexit.register(record_threads)  # first registered, so it runs after every handler the process adds
