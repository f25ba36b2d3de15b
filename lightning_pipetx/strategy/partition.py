"""Split a block list into contiguous stages with the smallest largest-stage cost."""

from __future__ import annotations

from collections.abc import Sequence


def partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Exact min-max contiguous partition of ``costs`` into ``num_stages`` non-empty ranges.

    Returns ``[(start, end), ...]`` per stage, ``end`` exclusive. Among the optimal
    partitions, the one with the most blocks on the later stages is returned (the first
    stage also runs ``pre``). Dynamic programming, ``O(num_stages * L^2)``.
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} stages: use a pipeline_length of at most {n}.")
    if any(c < 0 for c in costs):
        raise ValueError("block costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    inf = float("inf")
    # best[k][i]: smallest max-stage cost splitting blocks [i, n) into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(i + 1, n - k + 2):  # first stage is [i, j)
                value = max(prefix[j] - prefix[i], best[k - 1][j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], 0
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((i, j))
        i = j
    return bounds


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> list[float]:
    """Total cost of each stage."""
    return [float(sum(costs[start:end])) for start, end in bounds]
