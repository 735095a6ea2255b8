"""The read bandwidth one and two threads reach: the bound of a one-client decode step.

    python -m benchmarks.memory_bandwidth        # prints GB/s from 1 and 2 threads

Each thread sums its share of a 1 GiB float32 array with numpy (which releases the GIL),
best of 5. A decode step at one client reads every weight once, so its time is at least
the bytes of the weights over the two-thread figure: measure it the same hour as the
servers, on the same machine (it drifts with the host's load).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from benchmarks.compare_servers import cpu_flags

ARRAY_BYTES = 2**30
REPEATS = 5


def read_bandwidth(array: np.ndarray, threads: int) -> float:
    """Bytes of `array` per second when `threads` threads each sum a share of it."""
    parts = np.array_split(array, threads)
    best = float("inf")
    for _ in range(REPEATS):
        workers = [threading.Thread(target=part.sum) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - started)
    return array.nbytes / best


def main() -> None:
    print(f"CPU flags: {cpu_flags()}")
    array = np.ones(ARRAY_BYTES // 4, dtype=np.float32)
    for threads in (1, 2):
        print(f"{threads} thread(s): {read_bandwidth(array, threads) / 1e9:.1f} GB/s read")


if __name__ == "__main__":
    main()
