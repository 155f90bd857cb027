"""Steady growth of a memory figure, and how long until it meets a limit (pure).

Shared by ``worker-memory-growth`` (USS of each worker) and ``pinned-memory-growth``
(Mlocked, VmLck).  A figure is "growing steadily" when, over a window long enough,
it rose by a minimum amount at a minimum rate *and* its later half still climbs: the
burst of a worker's start-up (imports, caches warming, the first pages it touches)
rises and then stays flat, and stays quiet here.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["moved_since", "slope", "steady_growth", "time_to_limit"]


def moved_since(
    rss: int | None,
    minflt: int | None,
    rss_at_read: int | None,
    minflt_at_read: int | None,
    *,
    page_size: int,
    min_bytes: int,
) -> bool:
    """Whether a process's memory may have moved by ``min_bytes`` since its last USS read.

    Its private pages grow only by pages it faults in (a copy-on-write copy, a new page, a page
    locked in) and shrink with its RSS (pages freed or swapped out): with neither since the read,
    its USS moved only as far as other processes let go of pages they shared with it, and the
    read (a walk of its page tables, ~2.5 ms for a torch worker) would say what it said.
    Unknown figures count as moved.
    """
    if rss is None or minflt is None or rss_at_read is None or minflt_at_read is None:
        return True
    return (minflt - minflt_at_read) * page_size >= min_bytes or abs(rss - rss_at_read) >= min_bytes


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, value) points, value units per second; None with < 2 points."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var


def steady_growth(
    points: Sequence[tuple[float, float]],
    *,
    min_rate: float,
    min_rise: float,
    min_window_s: float,
    min_points: int = 4,
    late_share: float = 0.5,
) -> dict[str, Any] | None:
    """The growth of one figure over ``points`` (oldest first), or None when it is not steady.

    Steady: at least ``min_points`` over ``min_window_s``; the whole window's slope at
    least ``min_rate``; the last value at least ``min_rise`` above the window's lowest;
    and the later half of the window still rising at ``late_share`` of the whole window's
    rate (and of ``min_rate``): a curve flattening into a plateau after start-up fails this.
    """
    if len(points) < min_points:
        return None
    window_s = points[-1][0] - points[0][0]
    if window_s < min_window_s:
        return None
    rate = slope(points)
    if rate is None or rate < min_rate:
        return None
    rise = points[-1][1] - min(v for _, v in points)
    if rise < min_rise:
        return None
    mid = points[0][0] + window_s / 2
    late = [p for p in points if p[0] >= mid]
    late_rate = slope(late) if len(late) >= 2 else None
    if late_rate is None or late_rate < late_share * max(min_rate, rate):
        return None  # still rising, but slowing to a plateau: start-up, a cache filling up
    return {
        "rate_bytes_per_s": round(rate),
        "late_rate_bytes_per_s": round(late_rate),
        "rise_bytes": int(rise),
        "window_s": round(window_s, 1),
        "points": len(points),
        "first": int(points[0][1]),
        "last": int(points[-1][1]),
    }


def time_to_limit(headroom_bytes: int | None, rate_bytes_per_s: float) -> float | None:
    """Seconds until ``headroom_bytes`` are used at ``rate_bytes_per_s``; None when unknown."""
    if headroom_bytes is None or rate_bytes_per_s <= 0:
        return None
    return max(0.0, headroom_bytes / rate_bytes_per_s)
