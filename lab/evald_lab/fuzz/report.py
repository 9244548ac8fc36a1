"""The fuzz report: one JSON document, a readable summary (Markdown) and a small plot.

The JSON is the record (everything the run measured, every violation sample); the summary holds
the figures a README quotes: inputs and typed errors per class, crashes, limit escapes, the
largest latency, the daemon's RSS peak and the noisy-neighbour ratio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["summary_markdown", "write_report"]

_CLASS_ORDER = (
    "generated",
    "corpus",
    "modules",
    "protocol",
    "noisy_neighbour",
    "fault_kill9",
    "fault_disk_full",
)


def _ordered_classes(report: dict[str, Any]) -> list[str]:
    classes = list(report["classes"])
    return [c for c in _CLASS_ORDER if c in classes] + [c for c in classes if c not in _CLASS_ORDER]


def _overrun_row(latency: dict[str, Any]) -> str:
    count = latency.get("deadline_overruns", 0)
    if not count:
        return "| evaluations past their deadline | 0 |"
    return (
        f"| evaluations past their deadline | {count:,} (worst "
        f"{latency['worst_overrun_ms']:.1f} ms over a {latency['worst_overrun_deadline_ms']} ms "
        f"deadline, {latency['worst_overrun_class']}) |"
    )


def summary_markdown(report: dict[str, Any]) -> str:
    """The human summary of a report: the verdict and figures, then a section each for the
    classes, the noisy neighbour, the faults, the hardening list and the violation samples."""
    lines = [
        *_headline(report),
        *_figures(report),
        *_classes(report),
        *_noisy_neighbour(report),
        *_faults(report),
        *_hardening(report),
        *_violations(report),
    ]
    return "\n".join(lines) + "\n"


def _headline(report: dict[str, Any]) -> list[str]:
    verdict = "PASS" if report["totals"]["violations"] == 0 else "FAIL"
    daemon = report["daemon"]
    return [
        f"# evald fuzz — {report['profile']} profile: {verdict}",
        "",
        f"- seed {report['seed']}, budget {report['budget']}, {report['elapsed_s']:.0f} s "
        f"wall ({report['main_loop_s']:.0f} s main loop, "
        f"{report['inputs_per_s']:.0f} inputs/s), {report['machine']['cpus']} CPUs",
        f"- daemon: {daemon['kind']}, {daemon['threads']} worker threads; "
        f"victim limits {daemon['limits']['victim']}, attacker limits "
        f"{daemon['limits']['attacker']}",
        "",
    ]


def _figures(report: dict[str, Any]) -> list[str]:
    """The figures a README quotes, one table."""
    totals, latency, rss = report["totals"], report["latency"], report["rss"]
    lines = [
        "| figure | value |",
        "|---|---|",
        f"| inputs (all classes) | {totals['inputs']:,} |",
        f"| typed errors | {totals['typed_errors']:,} |",
        f"| crashes | {totals['crashes']} |",
        f"| hangs | {totals['hangs']} |",
        f"| limit escapes | {totals['limit_escapes']} |",
        f"| tenant leaks | {totals['tenant_leaks']} |",
        f"| state left by an earlier call (fresh isolation) | {totals.get('call_leaks', 0)} |",
        f"| violations (all kinds) | {totals['violations']} |",
        f"| max evaluation time | {latency['max_eval_ms']:.1f} ms |",
        _overrun_row(latency),
        f"| stalls (over a bound once, within it when repeated) | {totals['stalls']} "
        f"(longest {totals['max_stall_ms']:.0f} ms) |",
        f"| max call latency | {latency['max_call_ms']:.1f} ms |",
        f"| daemon RSS peak | {rss['peak_mib']:.0f} MiB (bound {rss['bound_mib']:.0f} MiB) |",
    ]
    noisy = report.get("noisy_neighbour") or {}
    if noisy:
        lines.append(
            f"| noisy-neighbour ratio (victim p50 / p99) | {noisy['ratio_p50']}x / "
            f"{noisy['ratio_p99']}x |"
        )
        registration = noisy.get("registration") or {}
        if registration:
            lines.append(
                f"| noisy-neighbour ratio, heavy registrations (victim p50 / p99) | "
                f"{registration['ratio_p50']}x / {registration['ratio_p99']}x |"
            )
    return lines


def _classes(report: dict[str, Any]) -> list[str]:
    """Inputs per class (a table), then each class's outcomes, most frequent first."""
    lines = [
        "",
        "## Inputs per class",
        "",
        "| class | inputs | ok | typed errors | other | violations | max eval ms | p99 call ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _ordered_classes(report):
        stats = report["classes"][name]
        other = stats["inputs"] - stats["ok"] - stats["typed_errors"]
        lines.append(
            f"| {name} | {stats['inputs']:,} | {stats['ok']:,} | {stats['typed_errors']:,} | "
            f"{other:,} | {sum(stats['violations'].values())} | "
            f"{stats['max_eval_us'] / 1000:.1f} | {stats['p99_call_ms']:.1f} |"
        )
    lines += [
        "",
        "Outcomes per class (error codes; `call:` a refused call; `transport:` gRPC's own "
        "limit before the daemon):",
        "",
    ]
    for name in _ordered_classes(report):
        outcomes = report["classes"][name]["outcomes"]
        shown = ", ".join(
            f"{label} {count:,}" for label, count in sorted(outcomes.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"- **{name}**: {shown}")
    return lines


def _noisy_neighbour(report: dict[str, Any]) -> list[str]:
    noisy = report.get("noisy_neighbour") or {}
    if not noisy:
        return []
    lines = [
        "",
        "## Noisy neighbour",
        "",
        f"Victim: {noisy['victim_call']}; attacker: {noisy['attacker_call']}, "
        f"{noisy['attackers']} threads, {noisy['attacker_calls']:,} calls "
        f"({noisy['attacker_outcomes']}); daemon worker threads: {noisy['daemon_threads']}.",
        "",
        "| victim latency | p50 ms | p99 ms | mean ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in (("alone", "alone"), ("under attack", "under_attack")):
        stats = noisy[key]
        lines.append(
            f"| {label} | {stats['p50_ms']} | {stats['p99_ms']} | {stats['mean_ms']} | "
            f"{stats['max_ms']} |"
        )
    lines.append(f"| ratio | {noisy['ratio_p50']}x | {noisy['ratio_p99']}x | | |")
    fewer = noisy.get("fewer_attackers")
    if fewer:
        lines += [
            "",
            f"With {fewer['attackers']} attacker thread(s), fewer than the daemon's "
            f"{fewer['daemon_threads']} workers (what a tenant `max_concurrency` below "
            f"`threads` enforces): victim p50 {fewer['alone']['p50_ms']} -> "
            f"{fewer['under_attack']['p50_ms']} ms, p99 {fewer['alone']['p99_ms']} -> "
            f"{fewer['under_attack']['p99_ms']} ms; ratio {fewer['ratio_p50']}x / "
            f"{fewer['ratio_p99']}x.",
        ]
    return lines


def _faults(report: dict[str, Any]) -> list[str]:
    faults = report.get("faults") or {}
    if not faults:
        return []
    lines = ["", "## Faults", ""]
    kill = faults.get("kill9")
    if kill:
        lines.append(
            f"- kill -9 under load ({kill['loaders']} clients, "
            f"{kill['call_deadline_s']} s call deadline): {kill['calls_failed']} calls "
            f"failed with {kill['failure_codes']}, the "
            f"slowest after {kill['max_failure_latency_ms']} ms; down {kill['down_s']} s, "
            f"restart {kill['restart_s']} s, every client recovered after "
            f"{kill['recovered_after_ms']} ms; modules before/after "
            f"{kill['modules_before']}/{kill['modules_after']} "
            f"(persisted: {kill['modules_persisted']})."
        )
    disk = faults.get("disk_full")
    if disk:
        cases = "; ".join(f"{c['case']}: {c['outcome']}" for c in disk["cases"])
        lines.append(f"- full disk ({disk['method']}): {cases}; passed: {disk['passed']}.")
    for name, reason in (faults.get("skipped") or {}).items():
        lines.append(f"- {name}: skipped ({reason}).")
    return lines


def _hardening(report: dict[str, Any]) -> list[str]:
    fixes = report.get("hardening") or []
    if not fixes:
        return []
    return [
        "",
        "## Hardening found by fuzzing (fixed, with regression tests)",
        "",
        *(f"- {fix}" for fix in fixes),
    ]


def _violations(report: dict[str, Any]) -> list[str]:
    if not report["violations"]:
        return []
    lines = ["", "## Violations (first samples)", ""]
    for violation in report["violations"][:50]:
        lines.append(
            f"- `{violation['kind']}` in {violation['class']}: {violation['detail']} "
            f"{violation['sample']}"
        )
    return lines


def _plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in _ordered_classes(report) if report["classes"][n]["inputs"]]
    ok = [report["classes"][n]["ok"] for n in names]
    typed = [report["classes"][n]["typed_errors"] for n in names]
    other = [
        report["classes"][n]["inputs"] - o - t for n, o, t in zip(names, ok, typed, strict=True)
    ]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = range(len(names))
    left.barh([r - 0.27 for r in rows], ok, height=0.27, label="value", color="#4c956c")
    left.barh(rows, typed, height=0.27, label="typed error", color="#f4a259")
    left.barh([r + 0.27 for r in rows], other, height=0.27, label="other", color="#8d99ae")
    left.set_yticks(list(rows), names)
    left.set_xscale("symlog")
    left.set_xlabel("inputs")
    left.set_title(
        f"{report['totals']['inputs']:,} inputs, {report['totals']['violations']} violations"
    )
    left.legend(loc="lower right", fontsize=8)
    left.invert_yaxis()
    noisy = report.get("noisy_neighbour")
    if noisy:
        labels = ["p50", "p99"]
        alone = [noisy["alone"]["p50_ms"], noisy["alone"]["p99_ms"]]
        loaded = [noisy["under_attack"]["p50_ms"], noisy["under_attack"]["p99_ms"]]
        xs = range(len(labels))
        right.bar([x - 0.2 for x in xs], alone, width=0.4, label="victim alone", color="#4c956c")
        right.bar(
            [x + 0.2 for x in xs], loaded, width=0.4, label="attacker burning", color="#c44536"
        )
        right.set_xticks(list(xs), labels)
        right.set_ylabel("victim call latency (ms)")
        right.set_title(f"noisy neighbour: {noisy['ratio_p50']}x p50, {noisy['ratio_p99']}x p99")
        right.legend(fontsize=8)
    else:
        right.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes ``<profile>.json``, ``<profile>.md`` and (with matplotlib) ``<profile>.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = report["profile"]
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    paths[1].write_text(summary_markdown(report))
    plot = out_dir / f"{stem}.png"
    if _plot(report, plot):
        paths.append(plot)
    return paths
