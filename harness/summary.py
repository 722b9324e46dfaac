"""A run's figures: per sweep point while it runs (progress, manifest) and as the
final table that `harness run` prints."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass
class PointStats:
    """Running figures of one sweep point, for the progress bar and the final table."""

    point_id: int
    point: dict[str, Any]
    method: str
    policy: str
    episodes: int = 0
    errors: int = 0
    rewards: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    grade_s: list[float] = field(default_factory=list)

    def add(self, row: dict[str, Any]) -> None:
        """Count one episode row (as written to the dataset)."""
        self.episodes += 1
        if row["error_type"] is not None:
            self.errors += 1
        if row["reward"] is not None:
            self.rewards.append(row["reward"])
            self.start_s.append(row["acquire_seconds"])
            self.grade_s.append(row["grade_seconds"])

    @property
    def mean_reward(self) -> float | None:
        return statistics.fmean(self.rewards) if self.rewards else None


@dataclass
class RunSummary:
    run_id: str
    run_dir: Path
    snapshot: str
    baseline: dict[str, Any]
    points: list[PointStats]
    seconds: float
    interrupted: bool = False
    episodes_total: int = 0

    @property
    def errors(self) -> int:
        return sum(p.errors for p in self.points)


def _p50(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def summary_table(summary: RunSummary) -> Table:
    """One row per sweep point: its swept values, then the figures."""
    baseline = summary.baseline.get("reward")
    table = Table(title=f"run {summary.run_id}: baseline reward {baseline}", caption=f"snapshot {summary.snapshot}")
    keys = list(summary.points[0].point) if summary.points else []
    if "method" not in keys:
        keys.append("method")
    for key in keys:
        table.add_column(key)
    for col in ("episodes", "mean reward", "errors", "start s p50", "grade s p50"):
        table.add_column(col, justify="right")
    for p in summary.points:
        values = [str(p.point.get(k, p.method if k == "method" else "")) for k in keys]
        mean = f"{p.mean_reward:.3f}" if p.mean_reward is not None else "-"
        table.add_row(*values, str(p.episodes), mean, str(p.errors), _p50(p.start_s), _p50(p.grade_s))
    return table
