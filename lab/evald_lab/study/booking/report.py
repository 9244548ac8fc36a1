"""The booking study's summary: rates per arm with 95 % Wilson intervals, paired exact McNemar
tests between arms, decision accuracy per message group, the issue's targets, a Markdown
table and a plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evald_lab.study.booking.arms import ARMS, COMPUTED_ARMS, SCHEMA_ONLY, TWO_CALLS
from evald_lab.study.booking.messages import GROUPS
from evald_lab.study.booking.records import BookingRecord, load_records, rescore
from evald_lab.study.run import mcnemar_exact_p, wilson_interval

__all__ = ["RATES", "BookingSummary", "complete_pairs", "resummarize", "summarize", "write_report"]

#: The per-arm rates: (key in the verdict, column title).
RATES = (
    ("schema_valid", "schema-valid"),
    ("decision_correct", "decision correct"),
    ("fully_correct", "4 fields correct"),
    ("consistent", "reply consistent"),
)
_FIELDS = ("action", "reason", "total", "age")


@dataclass
class BookingSummary:
    """Everything the table and the plot show, and the run's settings."""

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    targets: list[dict[str, Any]]

    def table_markdown(self) -> str:
        lines = []
        if self.config.get("partial"):
            lines += [f"(partial run: {sum(row['n'] for row in self.rows)} records so far)", ""]
        lines += [
            "| arm | n | "
            + " | ".join(title for _, title in RATES)
            + " | decision = policy(own facts) | tokens / message | wall ms / message |",
            "|---|---|" + "---|" * (len(RATES) + 3),
        ]
        for row in self.rows:
            cells = [_rate_cell(row[key]) for key, _ in RATES]
            follows = row["follows_facts"]
            lines.append(
                f"| {row['arm']} | {row['n']} | "
                + " | ".join(cells)
                + f" | {follows['count']}/{follows['of']} | {row['tokens_mean']:.1f} "
                f"| {row['wall_ms_mean']:.0f} (median {row['wall_ms_median']:.0f}) |"
            )
        lines += [
            "",
            "| arm | "
            + " | ".join(f"{f} correct" for f in _FIELDS)
            + " | components correct | decision errors | engine errors | prefill ms / message "
            "| after prefill ms / message |",
            "|---|" + "---|" * (len(_FIELDS) + 5),
        ]
        for row in self.rows:
            cells = [f"{row['fields'][f]}/{row['n']}" for f in _FIELDS]
            lines.append(
                f"| {row['arm']} | "
                + " | ".join(cells)
                + f" | {row['components_correct']}/{row['n']} | {row['decision_errors']} "
                f"| {row['engine_errors']} | {row['prefill_ms_mean']:.0f} "
                f"| {row['after_prefill_ms_mean']:.0f} |"
            )
        lines += ["", *self._groups_markdown(), "", *self._comparisons_markdown()]
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for target in self.targets:
            met = {True: "yes", False: "no", None: "n/a"}[target["met"]]
            lines.append(f"| {target['target']} | {target['measured']} | {met} |")
        return "\n".join(lines)

    def _groups_markdown(self) -> list[str]:
        arms = [row["arm"] for row in self.rows]
        lines = [
            "| group | n | " + " | ".join(f"{arm}: decision correct" for arm in arms) + " |",
            "|---|---|" + "---|" * len(arms),
        ]
        for group in self.groups:
            cells = [f"{group['arms'][arm]}" for arm in arms]
            lines.append(f"| {group['group']} | {group['n']} | " + " | ".join(cells) + " |")
        return lines

    def _comparisons_markdown(self) -> list[str]:
        lines = [
            "| measure | A vs B | pairs | only A right | only B right | exact McNemar p |",
            "|---|---|---|---|---|---|",
        ]
        for comp in self.comparisons:
            lines.append(
                f"| {comp['measure']} | {comp['a']} vs {comp['b']} | {comp['pairs']} | "
                f"{comp['only_a']} | {comp['only_b']} | {_format_p(comp['p_value'])} |"
            )
        return lines


def _rate(hits: int, n: int) -> dict[str, Any]:
    low, high = wilson_interval(hits, n)
    return {"count": hits, "n": n, "rate": hits / n if n else 0.0, "ci95": [low, high]}


def _rate_cell(rate: dict[str, Any]) -> str:
    low, high = rate["ci95"]
    return f"{rate['rate'] * 100:.1f}% ({rate['count']}) [{low * 100:.0f}-{high * 100:.0f}]"


def _format_p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _row(arm: str, group: Sequence[BookingRecord]) -> dict[str, Any]:
    n = len(group)
    verdicts = [r.verdict for r in group]
    decided = [v for v in verdicts if v.get("follows_facts") is not None]
    walls = [r.wall_ms for r in group]
    row: dict[str, Any] = {"arm": arm, "n": n}
    for key, _ in RATES:
        row[key] = _rate(sum(bool(v.get(key)) for v in verdicts), n)
    row["follows_facts"] = {
        "count": sum(bool(v["follows_facts"]) for v in decided),
        "of": len(decided),
        "rate": sum(bool(v["follows_facts"]) for v in decided) / len(decided) if decided else 0.0,
    }
    row["fields"] = {f: sum(bool(v["fields_correct"][f]) for v in verdicts) for f in _FIELDS}
    row["components_correct"] = sum(bool(v.get("components_correct")) for v in verdicts)
    row["decision_errors"] = sum(v.get("decision_error") is not None for v in verdicts)
    row["engine_errors"] = sum(r.engine_error is not None for r in group)
    row["flags"] = sum(len(v.get("consistency_flags", ())) for v in verdicts)
    row["tokens_mean"] = statistics.fmean(r.n_sampled + r.n_forced for r in group)
    row["sampled_mean"] = statistics.fmean(r.n_sampled for r in group)
    row["forced_mean"] = statistics.fmean(r.n_forced for r in group)
    row["calls"] = statistics.fmean(r.calls for r in group)
    row["wall_ms_mean"] = statistics.fmean(walls)
    row["wall_ms_median"] = statistics.median(walls)
    row["prefill_ms_mean"] = statistics.fmean(r.prefill_ms for r in group)
    row["after_prefill_ms_mean"] = row["wall_ms_mean"] - row["prefill_ms_mean"]
    return row


def _compare(records: Sequence[BookingRecord], measure: str, a: str, b: str) -> dict[str, Any]:
    def outcomes(arm: str) -> dict[tuple[Any, int], bool]:
        return {(r.seed, r.case_id): bool(r.verdict[measure]) for r in records if r.arm == arm}

    left, right = outcomes(a), outcomes(b)
    shared = sorted(set(left) & set(right), key=lambda key: (str(key[0]), key[1]))
    only_a = sum(left[k] and not right[k] for k in shared)
    only_b = sum(right[k] and not left[k] for k in shared)
    return {
        "measure": measure,
        "a": a,
        "b": b,
        "pairs": len(shared),
        "only_a": only_a,
        "only_b": only_b,
        "p_value": mcnemar_exact_p(only_a, only_b),
    }


def _targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it was met (``None``: an
    arm it needs did not run)."""
    out: list[dict[str, Any]] = []
    for arm in COMPUTED_ARMS:
        if arm in rows:
            follows = rows[arm]["follows_facts"]
            out.append(
                {
                    "target": f"{arm}: decision = policy(extracted facts) in 100 % of messages",
                    "measured": f"{follows['count']}/{follows['of']} decisions, "
                    f"of {rows[arm]['n']}",
                    "met": follows["count"] == follows["of"] == rows[arm]["n"],
                }
            )
    for arm in COMPUTED_ARMS:
        b = rows.get(arm)
        c, a = rows.get(TWO_CALLS), rows.get(SCHEMA_ONLY)
        accuracy = b["decision_correct"]["rate"] * 100 if b else None
        if c is not None:
            other = c["decision_correct"]["rate"] * 100
            out.append(
                _target(
                    f"{arm} decision accuracy >= two-calls",
                    accuracy,
                    f"{other:.1f}%",
                    None if b is None else accuracy >= other,
                )
            )
        if a is not None:
            other = a["decision_correct"]["rate"] * 100
            out.append(
                _target(
                    f"{arm} decision accuracy >= schema-only + 30 points",
                    accuracy,
                    f"{other:.1f}%",
                    None if b is None else accuracy >= other + 30,
                )
            )
        if b is not None and c is not None:
            ratio = b["wall_ms_mean"] / c["wall_ms_mean"]
            after = b["after_prefill_ms_mean"] / c["after_prefill_ms_mean"]
            out.append(
                {
                    "target": f"{arm} wall time per message <= 0.7x two-calls",
                    "measured": f"{b['wall_ms_mean']:.0f} ms vs {c['wall_ms_mean']:.0f} ms "
                    f"({ratio:.2f}x; after the prefill {after:.2f}x)",
                    "met": ratio <= 0.7,
                }
            )
    for arm, row in rows.items():
        valid = row["schema_valid"]
        out.append(
            {
                "target": f"{arm}: 100 % schema-valid",
                "measured": f"{valid['count']}/{valid['n']}",
                "met": valid["count"] == valid["n"],
            }
        )
    return out


def _target(name: str, value: float | None, other: str, met: bool | None) -> dict[str, Any]:
    measured = "not run" if value is None else f"{value:.1f}% vs {other}"
    return {"target": name, "measured": measured, "met": met}


def summarize(records: Sequence[BookingRecord], config: dict[str, Any]) -> BookingSummary:
    """Rates per arm, per-group accuracy, McNemar between every pair of arms (on decision
    correct and on all four fields), and the targets."""
    arms = [arm for arm in ARMS if any(r.arm == arm for r in records)]
    rows = {arm: _row(arm, [r for r in records if r.arm == arm]) for arm in arms}
    comparisons = [
        _compare(records, measure, a, b)
        for measure in ("decision_correct", "fully_correct")
        for i, a in enumerate(arms)
        for b in arms[i + 1 :]
    ]
    groups = []
    for name in GROUPS:
        part = [r for r in records if r.group == name]
        if not part:
            continue
        per_arm = {
            arm: f"{sum(r.verdict['decision_correct'] for r in part if r.arm == arm)}"
            f"/{sum(r.arm == arm for r in part)}"
            for arm in arms
        }
        groups.append(
            {"group": name, "n": len({(r.seed, r.case_id) for r in part}), "arms": per_arm}
        )
    return BookingSummary(
        config=config,
        rows=list(rows.values()),
        comparisons=comparisons,
        groups=groups,
        targets=_targets(rows),
    )


def write_report(summary: BookingSummary, out_dir: Path, *, plot: bool) -> None:
    """``summary.json``, ``table.md`` and (with ``plot``) ``booking.png`` under ``out_dir``."""
    (out_dir / "summary.json").write_text(
        json.dumps(asdict(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "table.md").write_text(summary.table_markdown() + "\n", encoding="utf-8")
    if plot:
        _plot(summary, out_dir / "booking.png")


_COLOURS = ("#90a4ae", "#2e7d32", "#1565c0", "#f9a825")


def _plot(summary: BookingSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary.rows
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12.5, 4.8), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    width = 0.8 / len(RATES)
    for k, ((key, title), colour) in enumerate(zip(RATES, _COLOURS, strict=True)):
        xs = [i + (k - (len(RATES) - 1) / 2) * width for i in range(len(rows))]
        values = [row[key]["rate"] * 100 for row in rows]
        spread = [
            [max(0.0, v - row[key]["ci95"][0] * 100) for v, row in zip(values, rows, strict=True)],
            [max(0.0, row[key]["ci95"][1] * 100 - v) for v, row in zip(values, rows, strict=True)],
        ]
        left.bar(xs, values, width, color=colour, label=title, yerr=spread, capsize=2)
        for x, value in zip(xs, values, strict=True):
            left.text(x, value + 1, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    left.set_xticks(range(len(rows)), [row["arm"] for row in rows], fontsize=9)
    left.set_ylim(0, 110)
    left.set_ylabel("% of messages (bars: 95% Wilson interval)")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=len(RATES))
    walls = [row["wall_ms_mean"] for row in rows]
    prefills = [row.get("prefill_ms_mean", 0.0) for row in rows]
    right.bar(range(len(rows)), prefills, color="#b39ddb", label="prefill")
    rest = [w - p for w, p in zip(walls, prefills, strict=True)]
    right.bar(range(len(rows)), rest, bottom=prefills, color="#6a1b9a", label="after prefill")
    right.legend(fontsize=7, loc="upper left")
    for i, row in enumerate(rows):
        right.text(
            i,
            walls[i],
            f"{walls[i]:.0f} ms\n{row['tokens_mean']:.0f} tok",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    right.set_xticks(range(len(rows)), [row["arm"] for row in rows], fontsize=8, rotation=15)
    right.set_ylabel("mean wall time per message (ms)")
    right.set_ylim(0, max(walls) * 1.25 if walls else 1)
    config = summary.config
    n = rows[0]["n"] if rows else 0
    fig.suptitle(
        f"Booking policy, {config.get('model_title') or config.get('model', '')}, "
        f"{config.get('backend', '')} backend, {n} messages per arm, "
        f"policy evaluator: {config.get('policy_evaluator', '')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def complete_pairs(records: Sequence[BookingRecord]) -> list[BookingRecord]:
    """The records of the (seed, message) pairs that ran in every arm present: a run cut short
    is summarised over paired messages only."""
    arms = {r.arm for r in records}
    seen: dict[tuple[Any, int], set[str]] = {}
    for r in records:
        seen.setdefault((r.seed, r.case_id), set()).add(r.arm)
    return [r for r in records if seen[(r.seed, r.case_id)] == arms]


def resummarize(out_dir: Path, *, plot: bool = True) -> BookingSummary:
    """Re-scores the records in ``out_dir`` from their texts, keeps the pairs that ran in every
    arm, and rewrites the summary, table and plot (the settings come from the old summary).

    Raises:
        FileNotFoundError: no ``records.jsonl`` there.
    """
    records = complete_pairs(rescore(load_records(out_dir / "records.jsonl")))
    old = out_dir / "summary.json"
    config: dict[str, Any] = (
        json.loads(old.read_text(encoding="utf-8"))["config"] if old.exists() else {}
    )
    summary = summarize(records, {**config, "partial": False})
    write_report(summary, out_dir, plot=plot)
    return summary
