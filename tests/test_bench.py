"""`make bench` end to end in its tiny form (BENCH_QUICK=1), so the tool can't rot; and the data-wait
measure it and every run report."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

from conftest import REPO, check
from ddp.meter import ThroughputMeter


def test_quick_bench_writes_the_table_the_ratios_and_a_plot(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--out", str(tmp_path)], cwd=REPO,
                            env=os.environ | {"BENCH_QUICK": "1"}, capture_output=True, text=True, timeout=300)
    check(result)
    (table,) = tmp_path.glob("*-quick.md")
    (plot,) = tmp_path.glob("*-quick.png")
    text = table.read_text()
    assert text.split("\n\n![")[0] in result.stdout  # printed too
    for contender in ("plain", "ddp", "ddp syncbn", "single"):
        (row,) = [line for line in text.splitlines() if line.startswith(f"| small_cnn | {contender} |")]
        throughput = float(row.split("|")[4].split()[0])
        assert throughput > 0, row
    for ratio in ("train.py DDP / plain loop, throughput, small_cnn", "train.py DDP / plain loop, whole-process wall time",
                  "syncbn=true / syncbn=false, step time, small_cnn", "weak scaling"):
        assert re.search(rf"\| {re.escape(ratio)}[^|]* \| \d+\.\d{{3}} \|", text), ratio
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.width > 100


def test_time_spent_waiting_for_batches_is_the_data_wait():
    """A loader that takes 20 ms per batch against steps that take none: nearly all the time is data
    wait; the warm-up step is left out, as from samples/s."""
    def slow_batches():
        for index in range(6):
            time.sleep(0.02)
            yield index

    meter = ThroughputMeter(warmup_steps=1, device=torch.device("cpu"))
    meter.resume()
    for _ in meter.timed(slow_batches()):
        meter.step(8)
    meter.pause()
    assert meter.samples == 5 * 8
    assert 0.5 < meter.data_wait_fraction <= 1
    assert meter.window_data_wait() == pytest.approx(meter.data_wait_fraction)
    assert meter.window_data_wait() == 0.0  # nothing timed since
