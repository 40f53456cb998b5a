"""How long the 17,920-rank GPT-3 layout takes to build, with every group list.

python -m benchmarks.topology
"""

import statistics
import time

from parallel.topology import AXES, Topology


def build_all(dp=64, pp=35, tp=8):
    t = Topology(dp, pp, tp)
    for axis in AXES:
        t.groups(axis)
    t.model_parallel_groups
    t.embedding_groups
    return t


def main(repeats: int = 7) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_all()
        times.append(time.perf_counter() - t0)
    result = {
        "layout": "dp=64 pp=35 tp=8 (17,920 ranks)",
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }
    print(
        f"Topology {result['layout']}: all group lists built in "
        f"{result['median_s'] * 1e3:.1f} ms median "
        f"(min {result['min_s'] * 1e3:.1f}, max {result['max_s'] * 1e3:.1f}, n={repeats})"
    )
    return result


if __name__ == "__main__":
    main()
