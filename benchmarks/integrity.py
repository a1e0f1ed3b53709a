"""make bench's integrity section: what checking bytes against their digests adds where a run trusts them.

- a checkpoint file (a torchvision model's weights and Adam's state, as train.py saves them: many records, most of
  them small, a few large), read from the page cache: `load_checkpoint` (torch.load while a thread checks every zip
  record's CRC-32, ddp/checkpoints/checkpoint.py) against `_load_file` (the same torch.load, unchecked), and
  `verify_file` alone (the CRC pass on its own) for context;
- a remote shard of random bytes, served over HTTP on 127.0.0.1, downloaded by `ShardCache.fetch` into an empty
  cache with its digest expected (the CRC-32 computed as the bytes arrive, data/shard_cache.py) against without,
  and a separate CRC pass of the copy (`file_crc32`) for context.

Interleaved repeats, each contender first in every other one; median (min-max). Each checkpoint load runs in a
fresh process, as a resume's does; the shard downloads in this one, after a warm-up of each.

`serve` (also used by benchmarks/shard_readers.py) runs the HTTP server in a process of its own: in the reader's
process its Python would take the reader's GIL, which a remote server never does. With a bandwidth it paces its
writes, over all its connections together, as a node's link would.

    python benchmarks/integrity.py FOLDER BYTES_PER_S   # the server serve() starts (0: unpaced); prints its port
"""

import contextlib
import functools
import http.server
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACING_CHUNK_BYTES = 256 * 2**10
# a checkpoint's load, the first of its process as a resume's is (in one process the next load could reuse the
# memory the last one freed, and skip the page faults a resume takes); torch.load's first-call imports left out
LOAD_IN_A_FRESH_PROCESS = """
import io, sys, time
from pathlib import Path
import torch
from ddp.checkpoints.checkpoint import _load_file, load_checkpoint
from ddp.checkpoints.verify import verify_file
from ddp.distributed.env import keep_freed_host_memory
keep_freed_host_memory()  # as a rank's process has it
buffer = io.BytesIO()
torch.save({"x": torch.zeros(1)}, buffer)
torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
started = time.perf_counter()
%s(Path(sys.argv[1]))
print(time.perf_counter() - started)
"""


@dataclass(frozen=True)
class IntegritySettings:
    model: str  # torchvision's: its checkpoint with Adam's state
    shard_mb: int
    repeats: int


# resnet101 with Adam: 511 MB in 1,574 records; mobilenet_v3_small: 29 MB in 676
INTEGRITY_FULL = IntegritySettings(model="resnet101", shard_mb=64, repeats=5)
INTEGRITY_QUICK = IntegritySettings(model="mobilenet_v3_small", shard_mb=4, repeats=1)
# checkpoint.py's loads, and verify.py's check alone
LOADS = {"torch.load (_load_file), unverified": "_load_file", "load_checkpoint, verified": "load_checkpoint",
         "verify_file alone (a sequential CRC-32 pass)": "verify_file"}
DOWNLOADS = {"ShardCache.fetch, digest expected (verified)": True, "ShardCache.fetch, no digest (unverified)": False}
CRC_PASS = "file_crc32 of the copy (a separate pass)"


def write_checkpoint(path: Path, model_name: str) -> None:
    """A torchvision model's weights and Adam's state after a step (exp_avg, exp_avg_sq and step for each parameter),
    saved as train.py saves a checkpoint (save_checkpoint: torch.save, fsync, rename)."""
    import torch
    import torchvision

    from ddp.checkpoints.checkpoint import save_checkpoint

    model = getattr(torchvision.models, model_name)()
    optimizer = torch.optim.Adam(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def checkpoint_loads(path: Path, repeats: int) -> dict[str, list[float]]:
    """{contender: seconds per repeat}, each load in a fresh process, the file in the page cache (just saved)."""
    path_with_repo = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path_with_repo, "OMP_NUM_THREADS": "1"}
    found: dict[str, list[float]] = {name: [] for name in LOADS}
    for repeat in range(repeats):
        for name, function in list(LOADS.items())[::1 if repeat % 2 else -1]:
            result = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS % function, str(path)], env=env,
                                    capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"bench: {name} failed:\n{result.stderr[-3000:]}")
            found[name].append(float(result.stdout.strip().splitlines()[-1]))
    return found


def shard_downloads(scratch: Path, settings: IntegritySettings) -> dict[str, list[float]]:
    """{contender: seconds per repeat}: a fresh cache dir for each download."""
    from data.shard_cache import ShardCache
    from ddp.checkpoints.verify import file_crc32

    folder = scratch / "served"
    folder.mkdir(parents=True)
    shard = folder / "train-000000.tar"
    shard.write_bytes(os.urandom(settings.shard_mb * 2**20))  # neither a download nor a CRC looks at what the bytes are
    digest = (shard.stat().st_size, f"{file_crc32(shard):08x}")
    found: dict[str, list[float]] = {name: [] for name in (*DOWNLOADS, CRC_PASS)}
    with serve(folder) as url:
        for repeat in range(-1, settings.repeats):
            for name, verified in list(DOWNLOADS.items())[::1 if repeat % 2 else -1]:
                cache = ShardCache(tempfile.mkdtemp(dir=scratch, prefix="shard-cache-"))
                if verified:
                    cache.expect({f"{url}/{shard.name}": digest})
                started = time.perf_counter()
                copy = cache.fetch(f"{url}/{shard.name}")
                timed = {name: time.perf_counter() - started}
                if not verified:  # the copy just written: from the page cache
                    started = time.perf_counter()
                    file_crc32(copy)
                    timed[CRC_PASS] = time.perf_counter() - started
                shutil.rmtree(cache.directory)
                if repeat >= 0:
                    for what, seconds in timed.items():
                        found[what].append(seconds)
    return found


def integrity_runs(settings: IntegritySettings, scratch: Path) -> tuple[dict, dict, tuple[int, int]]:
    """(checkpoint loads, shard downloads, the checkpoint's (bytes, records)): the section's measurements."""
    import zipfile

    scratch = Path(tempfile.mkdtemp(dir=scratch, prefix="integrity-"))
    checkpoint = scratch / "checkpoint.pt"
    print(f"bench: integrity checks: {settings.model}'s checkpoint, loaded with and without verification", flush=True)
    write_checkpoint(checkpoint, settings.model)
    with zipfile.ZipFile(checkpoint) as archive:
        checkpoint_size = (checkpoint.stat().st_size, len(archive.infolist()))
    loads = checkpoint_loads(checkpoint, settings.repeats)
    checkpoint.unlink()
    print(f"bench: integrity checks: a {settings.shard_mb} MB shard over HTTP, with and without its digest", flush=True)
    downloads = shard_downloads(scratch, settings)
    shutil.rmtree(scratch)
    return loads, downloads, checkpoint_size


def report(loads: dict[str, list[float]], downloads: dict[str, list[float]], checkpoint_size: tuple[int, int],
           settings: IntegritySettings) -> tuple[list[str], list[tuple]]:
    """The section's table lines and its ratio rows (what, ratio, goal)."""
    def cell(values: list[float], digits: int = 3) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    def rate(values: list[float], size: int) -> str:
        return f"{size / statistics.median(values) / 1e9:.2f}"

    shard_bytes, (checkpoint_bytes, records) = settings.shard_mb * 2**20, checkpoint_size
    lines = ["", f"Integrity checks: a checkpoint file of {checkpoint_bytes / 2**20:.0f} MB in {records} records (torchvision's "
             f"{settings.model} and Adam's state, save_checkpoint's), from the page cache, each load in a fresh process; "
             f"a shard of {settings.shard_mb} MB downloaded over HTTP from 127.0.0.1 (a server process of its own) into an empty "
             f"cache; {settings.repeats} interleaved repeats, median (min-max).", "",
             "| measurement | s | GB/s |", "|---|---|---|"]
    lines += [f"| checkpoint: {name} | {cell(values)} | {rate(values, checkpoint_bytes)} |" for name, values in loads.items()]
    lines += [f"| shard: {name} | {cell(values)} | {rate(values, shard_bytes)} |" for name, values in downloads.items()]
    unverified_load, verified_load, _ = (statistics.median(loads[name]) for name in LOADS)
    verified_fetch, unverified_fetch = (statistics.median(downloads[name]) for name in DOWNLOADS)
    rows = [(f"integrity: checkpoint load, verified / unverified (load_checkpoint / torch.load), {settings.model}, "
             f"{checkpoint_bytes / 2**20:.0f} MB", verified_load / unverified_load, "<= 1.10"),
            (f"integrity: shard download, verified / unverified (ShardCache.fetch), {settings.shard_mb} MB over HTTP",
             verified_fetch / unverified_fetch, "<= 1.10")]
    return lines, rows


class PacedHandler(http.server.SimpleHTTPRequestHandler):
    """Static files, at most `bytes_per_s` over all connections together (0: as fast as they go)."""

    bytes_per_s = 0.0
    link = threading.Lock()
    link_free_at = 0.0  # when the link has sent what it was given

    def copyfile(self, source, outputfile) -> None:
        if not self.bytes_per_s:
            return super().copyfile(source, outputfile)
        while chunk := source.read(PACING_CHUNK_BYTES):
            with PacedHandler.link:
                PacedHandler.link_free_at = max(time.monotonic(), PacedHandler.link_free_at) + len(chunk) / self.bytes_per_s
                sent_at = PacedHandler.link_free_at
            time.sleep(max(0.0, sent_at - time.monotonic()))
            outputfile.write(chunk)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path, bytes_per_s: float = 0.0):
    """`folder` over HTTP on 127.0.0.1 from a process of its own, for the with block: its base URL."""
    server = subprocess.Popen([sys.executable, __file__, str(folder), str(bytes_per_s)], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.terminate()
        server.wait()


def serve_forever(folder: str, bytes_per_s: float) -> None:
    PacedHandler.bytes_per_s = bytes_per_s
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(PacedHandler, directory=folder))
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve_forever(sys.argv[1], float(sys.argv[2]))
