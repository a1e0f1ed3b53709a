"""Remote shards in a node's cache (data/shard_cache.py), against a real HTTP server on 127.0.0.1
(Python's http.server over a folder, in a thread): one download per shard whatever the number of
processes asking, no half file ever in place, the cache kept within its limit, and a server that
doesn't answer is one line naming the URL."""

import functools
import http.server
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from data.shard_cache import ShardCache, ShardUnavailable


class Server:
    """A folder served on 127.0.0.1, every GET recorded; `cut_after`: bytes sent before it hangs up
    mid-file, or before it pauses `pause_s` and sends the rest. `stop_at`: the server stops, as if its
    machine went away, when it is asked for that file. `port`: a port to serve on again."""

    def __init__(self, folder: Path, cut_after: int | None = None, pause_s: float = 0.0, stop_at: str | None = None,
                 port: int = 0):
        self.requests: list[str] = []
        self.arrived = threading.Condition()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                with server.arrived:
                    server.requests.append(self.path)
                    server.arrived.notify_all()
                if self.path == stop_at:
                    threading.Thread(target=server.stop).start()
                    self.close_connection = True  # no answer
                    return
                if cut_after is None:
                    return super().do_GET()
                body = (folder / self.path.lstrip("/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:cut_after])
                self.wfile.flush()
                if pause_s:
                    time.sleep(pause_s)
                    self.wfile.write(body[cut_after:])
                # else the connection closes: a short read

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=str(folder)))
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout_s: float = 60.0) -> bool:
        """Whether predicate(requests) came true within timeout_s, waiting on the requests as they arrive."""
        with self.arrived:
            return self.arrived.wait_for(lambda: predicate(self.requests), timeout_s)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def shards(tmp_path) -> Path:
    folder = tmp_path / "served"
    folder.mkdir()
    for index in range(3):
        (folder / f"train-{index:06d}.tar").write_bytes(os.urandom(100_000))
    return folder


def test_each_shard_is_downloaded_once_by_a_node_whatever_asks_for_it(shards, tmp_path):
    """8 fetches at once of one shard (as the ranks and workers of a node start an epoch): one GET, the
    same whole file for all; a later fetch reads the cache."""
    server = Server(shards)
    try:
        url = f"{server.url}/train-000000.tar"
        with ThreadPoolExecutor(8) as pool:  # a flock is per open file: threads contend as processes do
            paths = list(pool.map(lambda _: ShardCache(tmp_path / "cache").fetch(url), range(8)))
        assert len(set(paths)) == 1 and paths[0].read_bytes() == (shards / "train-000000.tar").read_bytes()
        assert ShardCache(tmp_path / "cache").fetch(url) == paths[0]
        assert server.requests == ["/train-000000.tar"]
    finally:
        server.stop()


def test_a_download_cut_short_is_never_put_in_place(shards, tmp_path):
    """The server hangs up halfway through the file, every time: no file appears where readers look, no
    part file is left, and the error is one line naming the URL."""
    server = Server(shards, cut_after=50_000)
    cache = ShardCache(tmp_path / "cache", retries=2, timeout_s=5)
    try:
        url = f"{server.url}/train-000001.tar"
        with pytest.raises(ShardUnavailable) as raised:
            cache.fetch(url)
        assert len(server.requests) == 2
        assert not cache.path(url).exists()
        assert [path.name for path in (tmp_path / "cache").iterdir() if ".part-" in path.name] == []
        line = str(raised.value)
        assert "\n" not in line and line.startswith(f"{url}: unreachable after 2 tries") and line.endswith("serves it"), line
    finally:
        server.stop()


def test_a_shard_being_downloaded_is_not_read_before_it_is_whole(shards, tmp_path):
    """While one process is halfway through a download (the server pauses there), another asking for
    the shard waits, and both read the whole file (4 MiB: the first MiB is on disk before the pause)."""
    (shards / "train-000002.tar").write_bytes(os.urandom(4 << 20))
    server = Server(shards, cut_after=2 << 20, pause_s=1.0)
    url = f"{server.url}/train-000002.tar"
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(ShardCache(tmp_path / "cache").fetch, url)
            deadline = time.monotonic() + 10
            while not any(path.stat().st_size for path in (tmp_path / "cache").glob("*")) and time.monotonic() < deadline:
                time.sleep(0.01)  # until the first bytes are on disk
            second = ShardCache(tmp_path / "cache").fetch(url)
            whole = (shards / "train-000002.tar").read_bytes()
            assert second.read_bytes() == whole and first.result().read_bytes() == whole
        assert server.requests == ["/train-000002.tar"]
    finally:
        server.stop()


def test_the_cache_stays_within_its_limit_by_removing_the_least_recently_used_shards(shards, tmp_path):
    """A limit of 2.5 shards: fetching the third removes the least recently used one (and its index
    beside it), not the one just used."""
    server = Server(shards)
    cache = ShardCache(tmp_path / "cache", limit_gb=250_000 / 2**30)
    try:
        first, second = (cache.fetch(f"{server.url}/train-00000{index}.tar") for index in (0, 1))
        Path(f"{first}.idx.json").write_text("{}")
        time.sleep(0.01)
        cache.fetch(f"{server.url}/train-000000.tar")  # used again: the second is now the least recent
        third = cache.fetch(f"{server.url}/train-000002.tar")
        assert first.exists() and third.exists() and not second.exists()
        assert sum(path.stat().st_size for path in (tmp_path / "cache").glob("*.tar")) <= 250_000
        cache.fetch(f"{server.url}/train-000001.tar")  # back: the first is now the oldest
        assert not first.exists() and not Path(f"{first}.idx.json").exists()
    finally:
        server.stop()


def test_a_server_that_is_gone_is_one_line_naming_the_url_after_bounded_retries(shards, tmp_path):
    server = Server(shards)
    url = f"{server.url}/train-000000.tar"
    server.stop()
    started = time.monotonic()
    with pytest.raises(ShardUnavailable) as raised:
        ShardCache(tmp_path / "cache", retries=2, timeout_s=2).fetch(url)
    assert time.monotonic() - started < 30
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{url}: unreachable after 2 tries (") and "refused" in line.lower(), line


def test_a_cached_copy_that_no_longer_matches_its_digest_is_not_read_but_downloaded_again(shards, tmp_path, caplog):
    """A shard's digest known (dataset.json's): the first fetch downloads and checks it; a bit flipped in the cached
    copy is found by the next process that reads it (a new cache object), which downloads it again."""
    import zlib

    from test_integrity import flip_bit

    url_path = "/train-000000.tar"
    content = (shards / "train-000000.tar").read_bytes()
    server = Server(shards)
    url = server.url + url_path
    digest = {url: (len(content), f"{zlib.crc32(content):08x}")}
    try:
        first = ShardCache(tmp_path / "cache")
        first.expect(digest)
        cached = first.fetch(url)
        flip_bit(cached, 5000, 3)
        assert first.fetch(url).read_bytes() != content  # checked once per process: this one has
        second = ShardCache(tmp_path / "cache")
        second.expect(digest)
        with caplog.at_level("WARNING"):
            assert second.fetch(url).read_bytes() == content
    finally:
        server.stop()
    assert server.requests.count(url_path) == 2
    assert f"the cached copy of {url} fails its digest (CRC-32" in caplog.text
