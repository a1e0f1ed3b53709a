"""Remote shards (`http://`, `https://`) in a local cache: each shard is downloaded once per node into
`data.cache_dir`, which the ranks and loader workers of a node share, and read from there.

- Once: a process takes the shard's lock file (an exclusive flock) before downloading; the others wait
  on it, then find the shard there.
- Never half: a download goes to `<name>.part-<pid>` and is renamed into place (fsync, os.replace)
  once complete, so a reader only ever opens whole shards; a killed download leaves a part file that
  the next download of that shard replaces.
- Bounded: with `data.cache_limit_gb`, the least recently used shards are removed before a download
  would exceed it (a shard in use stays readable: an open file outlives its removal).
- A server that doesn't answer: bounded retries with backoff, then one line naming the URL. The run
  stops there with its checkpoints intact, and the line ends with the command that continues it once
  the server is back (ddp/jobs/failures.py).
- Verified: where the shards' `dataset.json` (python -m data.shards) lists a shard's size and CRC-32, a
  download that doesn't match them is not put in place: it is downloaded once more, then the run stops
  with one line naming the URL and both digests. A cached copy is checked again by each process that
  first reads it, and downloaded again where it no longer matches.
- Ahead of time: `Prefetcher` downloads the shards the sampler names next (data.shuffle_window's next
  window) on a thread of the process, so the reads find them in the cache.
"""

import fcntl
import hashlib
import http.client
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from data.vision import BadSample
from ddp.checkpoints.verify import file_crc32

log = logging.getLogger(__name__)
RETRIES = 3
TIMEOUT_S = 30.0
CHUNK_BYTES = 1 << 20


def is_remote(location: str) -> bool:
    return location.startswith(("http://", "https://"))


class ShardUnavailable(BadSample):
    """A remote shard that couldn't be fetched: one line naming its URL."""

    continues_once_fixed = True  # the run's failure line adds the command that continues it (ddp/jobs/failures.py)


class ShardCorrupt(ShardUnavailable):
    """A remote shard whose download, twice, doesn't match its digest in dataset.json."""


def shard_problem(path: Path, size: int, crc32: str) -> str | None:
    """What differs between a shard and its digest in dataset.json (its size in bytes, its CRC-32 in hex), or None."""
    actual = path.stat().st_size
    return digest_problem(actual, file_crc32(path) if actual == size else 0, size, crc32)


def digest_problem(size: int, crc: int, listed_size: int, listed_crc: str) -> str | None:
    if size != listed_size:
        return f"{size} bytes where dataset.json lists {listed_size}"
    return None if f"{crc:08x}" == listed_crc else f"CRC-32 {crc:08x} where dataset.json lists {listed_crc}"


class ShardCache:
    def __init__(self, cache_dir: str | Path, limit_gb: float | None = None, retries: int = RETRIES,
                 timeout_s: float = TIMEOUT_S):
        self.directory, self.retries, self.timeout_s = Path(cache_dir), retries, timeout_s
        self.limit_bytes = None if limit_gb is None else int(limit_gb * 2**30)
        self.digests: dict[str, tuple[int, str]] = {}  # url: (bytes, CRC-32) of dataset.json, checked on every download
        self._verified: set[str] = set()  # the cached copies this process has checked

    def expect(self, digests: dict[str, tuple[int, str]]) -> None:
        """The shards' digests (dataset.json's), by URL: their downloads and cached copies are checked against them."""
        self.digests.update(digests)

    def path(self, url: str) -> Path:
        """Where `url` is cached: its file name, prefixed with a digest of the whole URL (two servers' train-0.tar differ)."""
        return self.directory / f"{hashlib.sha1(url.encode()).hexdigest()[:12]}-{Path(url.split('?')[0]).name}"

    def fetch(self, url: str, missing_ok: bool = False) -> Path | None:
        """The local path of `url`'s whole file, downloading it first if no process of this node has.
        missing_ok: None for a file the server doesn't have (404), at once, where it is optional."""
        target = self.path(url)
        if target.exists() and self._intact(url, target):
            os.utime(target)  # its use, for the least-recently-used eviction
            return target
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process of this node may be downloading it
            if not (target.exists() and self._intact(url, target)) and not self._download(url, target, missing_ok):
                return None
        return target

    def _intact(self, url: str, target: Path) -> bool:
        """Whether a cached copy matches its digest, checked once per process; one that doesn't is removed."""
        if url not in self.digests or url in self._verified:
            return True
        if problem := shard_problem(target, *self.digests[url]):
            log.warning("%s: the cached copy of %s fails its digest (%s); downloading it again", target, url, problem)
            target.unlink(missing_ok=True)
            return False
        self._verified.add(url)
        return True

    def read(self, url: str, missing_ok: bool = False) -> bytes | None:
        """A small file's bytes straight from the server, not cached (dataset.json: a conversion may
        have finished since); None for a 404 where missing_ok."""
        return self._get(url, lambda response: response.read(), missing_ok)

    def _download(self, url: str, target: Path, missing_ok: bool = False) -> bool:
        """False for a 404 where missing_ok; else the file in place, or ShardUnavailable. Called with the
        shard's lock held: a part file left by a process killed mid-download is stale, and goes."""
        for stale in target.parent.glob(f"{target.name}.part-*"):
            stale.unlink(missing_ok=True)
        part = target.with_name(f"{target.name}.part-{os.getpid()}-{threading.get_ident()}")

        def save(response) -> bool | str:
            """True once the file is in place; what differs from its digest, where it doesn't match. The CRC-32 is
            computed as the bytes arrive: no second read (make bench's integrity row)."""
            crc = 0
            with open(part, "wb") as out:
                length = response.headers.get("Content-Length")
                self._make_room(int(length or 0), keep=target)
                while chunk := response.read(CHUNK_BYTES):
                    out.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                # a connection closed early ends a chunked read without an error: count the bytes
                if length is not None and out.tell() != int(length):
                    raise ConnectionError(f"the connection closed after {out.tell()} of {length} bytes")
                out.flush()
                os.fsync(out.fileno())
            if url in self.digests and (problem := digest_problem(part.stat().st_size, crc, *self.digests[url])):
                return problem
            os.replace(part, target)
            self._verified.add(url)
            return True

        try:
            for attempt in range(2):  # a download that fails its digest (a proxy mangled it, say) gets one more try
                saved = self._get(url, save, missing_ok)
                if saved is None or saved is True:
                    return saved is True
                if attempt == 0:
                    log.warning("%s: the download fails its digest (%s); downloading it once more", url, saved)
            raise ShardCorrupt(f"{url}: downloaded twice, it fails its digest ({saved}): the server's shard is not the one "
                               "converted; serve the shards and dataset.json that python -m data.shards wrote together")
        finally:
            part.unlink(missing_ok=True)

    def _get(self, url: str, handle, missing_ok: bool):
        """handle(response), tried `retries` times with backoff; None for a 404 where missing_ok."""
        reason = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(min(2.0**attempt, 10.0))  # backoff: a server restarting gets a few seconds
            try:
                with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                    return handle(response)
            except urllib.error.HTTPError as error:
                if error.code == 404 and missing_ok:
                    return None
                reason = f"HTTP {error.code} {error.reason}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, http.client.HTTPException) as error:
                reason = " ".join(str(getattr(error, "reason", error)).split()) or type(error).__name__
        raise ShardUnavailable(f"{url}: unreachable after {self.retries} tries ({reason}); check that the server serves it")

    def _make_room(self, incoming: int, keep: Path) -> None:
        """Remove the least recently used shards (with the files kept beside them, an index) until
        `incoming` more bytes fit within the limit."""
        if self.limit_bytes is None:
            return
        shards = [path for path in self.directory.iterdir() if path != keep and path.suffix == keep.suffix]
        used = sum(path.stat().st_size for path in shards)
        for path in sorted(shards, key=lambda path: path.stat().st_mtime):
            if used + incoming <= self.limit_bytes:
                break
            used -= path.stat().st_size
            for stale in [path, *(sibling for sibling in self.directory.glob(f"{path.name}.*") if not sibling.name.endswith(".lock"))]:
                stale.unlink(missing_ok=True)


class Prefetcher:
    """Downloads shards into the cache on a daemon thread of this process, in the order asked, so that
    the reads that follow find them there (they wait on the shard's lock while it downloads). A failed
    prefetch is left to the read, which retries and names the URL. Made lazily in each process that asks;
    a DataLoader worker gets none (`__getstate__`)."""

    def __init__(self, cache: ShardCache):
        self.cache = cache
        self.requests: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._run, name="shard-prefetch", daemon=True).start()

    def __call__(self, urls: list[str]) -> None:
        for url in urls:
            self.requests.put(url)

    def _run(self) -> None:
        while True:
            url = self.requests.get()
            try:
                self.cache.fetch(url)
            except (BadSample, OSError) as error:
                log.debug("prefetch of %s failed (%s); the read will retry it", url, error)
