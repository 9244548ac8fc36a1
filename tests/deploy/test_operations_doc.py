"""docs/operations.md names the metrics the daemon really exports."""

from __future__ import annotations

import re
from pathlib import Path

from evald.daemon._metrics import Metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_documented_metrics_exist_with_their_labels() -> None:
    metrics = Metrics()
    metrics.observe_evaluation("local", "calc", "ok", elapsed_us=7, fuel_used=1200)
    metrics.observe_rpc("Evaluate", "local", "ok")
    metrics.inflight.labels("local").set(0)
    metrics.modules.labels("local").set(0)
    metrics.cpus.labels("0-1").set(2)
    exported: dict[str, set[str]] = {}
    for line in metrics.render().decode().splitlines():
        if "_created{" in line:  # creation timestamps prometheus_client adds to every series
            continue
        match = re.match(r"(evald_[a-z_]+?)(?:_bucket|_sum|_count)?\{([^}]*)\}", line)
        if match:
            labels = {pair.split("=")[0] for pair in match.group(2).split(",") if pair}
            exported.setdefault(match.group(1), set()).update(labels - {"le"})
    rows = re.findall(r"^\| `(evald_[a-z_]+)` \| [^|]+ \| ([^|]+) \|", DOC.read_text(), re.M)
    assert len(rows) >= 5, "the metrics table in docs/operations.md was not found"
    for name, labels in rows:
        assert name in exported, f"{name} is documented but not exported ({sorted(exported)})"
        documented = set(re.findall(r"`([a-z_]+)`", labels))
        assert documented == exported[name], f"{name}: labels {documented} != {exported[name]}"
    undocumented = set(exported) - {name for name, _ in rows}
    assert not undocumented, f"exported but not in docs/operations.md: {sorted(undocumented)}"
