"""What the Python service benchmarks share (bench/http_bench.py, bench/prefix_cache_bench.py)."""

import time


def wait_for_file(path, timeout=60):
    """The integer a starting `pinfer serve` writes to a port file, once it is there."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {path}")
