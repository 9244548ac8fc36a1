"""``evald bench``: each benchmark runs on a tiny profile and writes a well-formed result file.

Timings are never asserted (the machine is shared and noisy); what is asserted is the shape of
the results, that every configuration was measured, and that the derived columns are computed
from the rows they claim to be computed from.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evald.cli import main
from evald_lab.bench._headline import README_BEGIN, README_END, headline_markdown, write_headline
from evald_lab.bench._overhead import PROFILES, _configs, overhead_headline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def overhead(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One tiny run through the CLI (no model: the decode-step column stays empty)."""
    out = tmp_path_factory.mktemp("bench")
    status = main(
        [
            "bench",
            "overhead",
            "--profile",
            "tiny",
            "--out",
            str(out),
            "--no-progress",
            "--no-decode-step",
        ]
    )
    assert status == 0
    return out, json.loads((out / "overhead.json").read_text())


def test_overhead_writes_every_configuration(overhead: tuple[Path, dict]) -> None:
    out, document = overhead
    assert document["benchmark"] == "overhead"
    assert document["profile"] == "tiny"
    profile = PROFILES["tiny"]
    rows = document["rows"]
    assert len(rows) == len(_configs(profile)) == profile.configurations_per_round
    keys = {
        (r["path"], r["transport"], r["rpc"], r["items_per_message"], r["concurrency"], r["input"])
        for r in rows
    }
    assert len(keys) == len(rows)
    for transport in profile.transports:
        rpcs = ("stream",) if transport == "data" else ("unary", "batch", "stream")
        for rpc in rpcs:
            assert any(r["transport"] == transport and r["rpc"] == rpc for r in rows)
    # the data path's floor: the same frames to a process that does not evaluate
    for items in profile.items_per_message:
        assert any(r["path"] == "raw-uds" and r["items_per_message"] == items for r in rows)
    for row in rows:
        assert row["evals"] > 0, row
        assert 0 < row["p50_us"] <= row["p99_us"], row
        assert row["evals_per_s"] > 0, row
        assert row["decode_step_fraction"] is None  # --no-decode-step
        assert row["errors"] == 0, row
        if row["path"] in ("evald", "raw-uds"):
            assert row["daemon_cpu_us_per_eval"] is not None
            assert row["evals"] % row["items_per_message"] == 0
        else:
            assert row["daemon_cpu_us_per_eval"] is None
    assert (out / "overhead.png").read_bytes().startswith(PNG_MAGIC)
    assert document["machine"]["logical_cpus"] >= 1
    assert "wasmtime" in document["machine"]["packages"]


def test_ratios_are_taken_against_the_python_row_of_the_same_input_and_concurrency(
    overhead: tuple[Path, dict],
) -> None:
    rows = overhead[1]["rows"]
    for row in rows:
        base = next(
            r
            for r in rows
            if r["path"] == "python"
            and r["input"] == row["input"]
            and r["concurrency"] == row["concurrency"]
        )
        assert row["vs_python_p50"] == pytest.approx(row["p50_us"] / base["p50_us"], rel=1e-2)
        if row["path"] == "python":
            assert row["vs_python_p50"] == 1.0


def test_headline_names_the_engine_path(overhead: tuple[Path, dict]) -> None:
    headline = overhead[1]["headline"]
    stream = headline["evald_vs_python_latency"]
    assert stream["value"] == pytest.approx(
        stream["evald_p50_us"] / stream["python_p50_us"], rel=1e-2
    )
    floor = headline["evald_data_vs_raw_floor"]
    assert floor["value"] == pytest.approx(floor["evald_p50_us"] / floor["raw_p50_us"], rel=1e-2)
    table = headline_markdown(overhead[1], None)
    assert table.startswith("| measure | this run | target | met |")
    assert "evald ÷ in-process Python" in table
    assert "raw unix-socket round trip" in table
    assert "Measured on" in table


def test_overhead_fresh_versus_reuse_covers_every_input(overhead: tuple[Path, dict]) -> None:
    rows = overhead[1]["rows"]
    versus = overhead[1]["headline"]["wasm_fresh_vs_reuse"]
    assert list(versus["inputs"]) == list(PROFILES["tiny"].inputs)
    # one input past the target fails the whole measure, whichever input it is
    slow = [
        {**row, "p50_us": row["p50_us"] * 10}
        if row["path"] == "wasm-fresh" and row["input"] == "strop-short"
        else row
        for row in rows
    ]
    assert overhead_headline(rows, None)["wasm_fresh_vs_reuse"]["inputs"].keys() == {
        "calc-short",
        "strop-short",
    }
    assert not overhead_headline(slow, None)["wasm_fresh_vs_reuse"]["met"]


def test_headline_refreshes_only_the_marked_block(
    tmp_path: Path, overhead: tuple[Path, dict]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{README_BEGIN}\nold table\n{README_END}\nafter\n")
    write_headline(tmp_path / "out", overhead[1], None, readme=readme)
    text = readme.read_text()
    assert "old table" not in text
    assert text.startswith("# title\n\nbefore\n")
    assert text.endswith(f"{README_END}\nafter\n")
    assert "| measure |" in text
    assert (tmp_path / "out" / "headline.md").exists()
    rows = json.loads((tmp_path / "out" / "headline.json").read_text())["rows"]
    assert rows and all({"measure", "value", "target", "met"} <= set(row) for row in rows)


def test_headline_refuses_a_readme_without_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="evald-bench:begin"):
        write_headline(tmp_path / "out", None, None, readme=readme)
    assert readme.read_text() == "# no markers\n"


def test_readme_option_needs_the_all_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["bench", "overhead", "--readme", str(tmp_path / "R.md"), "--no-progress"])
    assert status == 2
    assert "--readme needs the `all` or `headline` job" in capsys.readouterr().err


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "overhead", "--profile", "huge"])


def test_profile_breaks_the_time_down(tmp_path: Path) -> None:
    from evald_lab.bench._profile import run_profile

    document = run_profile("tiny", out_dir=tmp_path, gil_profile=False)
    parts = document["host"]["cpu_us"]
    assert parts["evaluate (whole)"] > 0
    assert {"guest call (ctypes, GIL released)", "python glue (the rest)"} <= set(parts)
    # the named parts and the rest add up to the whole, by construction
    assert sum(v for k, v in parts.items() if k != "evaluate (whole)") == pytest.approx(
        parts["evaluate (whole)"], abs=0.05
    )
    for key in ("daemon", "daemon_data_path"):
        daemon = document[key]
        assert daemon["items"] > 0 and daemon["items"] % 64 == 0
        assert daemon["daemon_cpu_us_per_item"] > 0
        assert daemon["thread_cpu_us_per_item"]
    assert document["daemon_data_path"]["rpc"].startswith("data path")
    assert json.loads((tmp_path / "profile.json").read_text())["benchmark"] == "profile"
    assert "CPU µs" in (tmp_path / "profile.md").read_text()


def test_headline_job_rebuilds_from_saved_results(
    tmp_path: Path, overhead: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    out = overhead[0]
    assert main(["bench", "headline", "--out", str(out)]) == 0
    assert "| measure | this run |" in capsys.readouterr().out
    assert (out / "headline.md").exists()
    assert main(["bench", "headline", "--out", str(tmp_path / "empty")]) == 2
    assert "no results" in capsys.readouterr().err


@pytest.mark.slow
def test_the_registration_benchmark_runs(tmp_path: Path) -> None:
    from evald_lab.bench.registration import run

    result = run(0.3, 1, tmp_path)
    assert set(result["variants"]) == {"in-process", "worker-process"}
    for figures in result["variants"].values():
        assert figures["registrations"] >= 1 and figures["ratio_p99"] > 0
    assert result["oracle"]["ratio_unseen_over_seen"] > 0
    assert json.loads((tmp_path / "registration.json").read_text())["benchmark"] == "registration"


def test_the_heavy_tenants_benchmark_runs(tmp_path: Path) -> None:
    from evald_lab.bench.heavy_tenants import run

    result = run(20, 1, tmp_path)
    assert set(result["conditions"]) == {"quiet", "busy", "service"}
    for figures in result["conditions"].values():
        for nice in ("nice_0", "nice_19"):
            assert figures[nice]["under_attack"]["p99_ms"] > 0
            assert figures[nice]["attacker_calls_per_s"] > 0
            assert figures[nice]["daemon_cpu_share"] > 0
        assert figures["lowered_over_normal"]["p99_ms"] > 0
    saved = json.loads((tmp_path / "heavy_tenants.json").read_text())
    assert saved["benchmark"] == "heavy_tenants" and (tmp_path / "heavy_tenants.png").exists()


def test_a_failed_heavy_tenants_configuration_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration that fails half way, with a daemon that then does not drain (SIGSTOPped:
    a real daemon that cannot answer SIGTERM), still ends its two CPU hogs, its daemon and the
    attacker's threads before the error reaches the caller; before, the daemon's stop timed out
    and the hogs kept looping for the rest of the suite. The victim phase is replaced to fail
    on cue (the failure itself, a call past its deadline, depends on the machine's load)."""
    import os
    import signal

    from evald.testing import process_alive, process_descendants
    from evald_lab.bench import heavy_tenants

    class InjectedFailure(Exception):
        pass

    phases = iter([([1.0], 0), ([1.0], 0)])

    def victim(client: object, samples: int) -> tuple[list[float], int]:
        phase = next(phases, None)
        if phase is None:  # the phase under attack: the hogs, daemon and burners are all up
            # the suite's own daemons are older: only this configuration's count
            below = process_descendants(os.getpid()).items()
            started = {pid: cmd for pid, cmd in below if pid not in before}
            daemons = [pid for pid, cmd in started.items() if "serve" in cmd]
            assert len(started) >= 3 and len(daemons) == 1
            os.kill(daemons[0], signal.SIGSTOP)
            raise InjectedFailure
        return phase

    monkeypatch.setattr(heavy_tenants, "_victim", victim)
    monkeypatch.setattr(heavy_tenants, "STOP_TIMEOUT_S", 2.0)
    before = set(process_descendants(os.getpid()))
    with pytest.raises(InjectedFailure):
        heavy_tenants._one(tmp_path, 19, "service", 5)
    # What this configuration started: not what older processes (the session's PostgreSQL,
    # its daemons) started meanwhile, and not this process's multiprocessing resource tracker,
    # which one per process serves every later use and lives as long as the process.
    now = process_descendants(os.getpid())
    under_older = {pid for older in before & now.keys() for pid in process_descendants(older)}
    left = {
        pid: cmd
        for pid, cmd in now.items()
        if pid not in before | under_older
        and "multiprocessing.resource_tracker" not in cmd
        and process_alive(pid)
    }
    assert not left


def test_the_host_benchmark_compares_the_guest_languages(tmp_path: Path) -> None:
    """``evald bench host --languages-only``: one row per implementation of checksum, in the
    order the table quotes them, and the Markdown table docs/writing-evaluators.md shows."""
    from evald_lab.bench.languages import implementations

    results, table = tmp_path / "host.json", tmp_path / "languages.md"
    status = main(["bench", "host", "--languages-only", "--quick", "--json", str(results),
                   "--table", str(table)])  # fmt: skip
    assert status == 0
    rows = json.loads(results.read_text())["languages"]
    assert [row["language"] for row in rows] == ["Zig", "Rust", "AssemblyScript"]
    assert [row["module"] for row in rows] == [name for _, name, _ in implementations()]
    for row in rows:
        assert row["module_bytes"] > 0 and row["compile_ms"] > 0 and row["fuel_small"] > 0
        assert row["p50_reused_us"] > 0 and row["p50_fresh_us"] > 0
        assert 1 < row["memory_pages"] < 1024  # 64 MiB, the default cap, in pages
        assert row["fuel_sha256_1mib"] < 200_000_000  # within the default fuel
    lines = table.read_text().splitlines()
    assert len(lines) == 2 + len(rows) and lines[2].startswith("| Zig | ")


def test_the_control_plane_benchmark_runs(tmp_path: Path) -> None:
    from evald.testing import postgres_bindir
    from evald_lab.bench.control_plane import run

    if postgres_bindir() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    result = run(2, 20, 1, tmp_path)
    assert result["registration"]["per_daemon"]["n"] == 6
    assert result["revocation"]["codes"] == ["data:unauthenticated", "unauthenticated"]
    assert result["limits"]["next_call_saw_it"] == 1.0
    assert result["hot_path"]["ratio_p50"] > 0
    saved = json.loads((tmp_path / "control_plane.json").read_text())
    assert saved["benchmark"] == "control_plane" and (tmp_path / "control_plane.png").exists()


def test_a_failed_control_plane_setup_leaves_no_cluster_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setup step that fails after the cluster started (on a busy machine, a connection that
    times out) stops the cluster and removes its folder. The failure is a fake (a raising
    ``init_store``): a timeout cannot be had on demand; the cluster is real."""
    from evald.contract import ErrorCode, EvaldError
    from evald.testing import PostgresServer, postgres_bindir, start_postgres
    from evald_lab.bench import control_plane

    if postgres_bindir() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    started: list[PostgresServer] = []

    def start() -> PostgresServer:
        started.append(start_postgres())
        return started[-1]

    def fail(*_: object) -> int:
        raise EvaldError(ErrorCode.UNAVAILABLE, "connection timeout expired (injected)")

    monkeypatch.setattr(control_plane, "start_postgres", start)
    monkeypatch.setattr(control_plane, "init_store", fail)
    with pytest.raises(EvaldError, match="injected"):
        control_plane.run(2, 20, 1, tmp_path)
    assert len(started) == 1 and not started[0].running() and not started[0].root.exists()
