"""The measurements of one part each run from their commands and write what they say they write
(their numbers are measured, never asserted): ``evald bench daemon|host|registration|workers``
and ``engine-adapter bench mask-fill``, each with its smallest settings. The SGLang and vLLM
jobs need their servers' venvs: ``sglang-overhead`` and ``vllm-overhead`` are run by their own
tests here, the server benchmarks by hand (docs/sglang.md, docs/vllm.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_adapter.cli import main as adapter_main
from evald.cli import main as evald_main


def test_bench_daemon_writes_fresh_beside_reuse_for_every_path(tmp_path: Path) -> None:
    out = tmp_path / "daemon.json"
    argv = ["bench", "daemon", "--rounds", "1", "--calls", "5", "--memory-s", "0.2"]
    argv += ["--json", str(out)]
    assert evald_main(argv) == 0
    document = json.loads(out.read_text())
    assert document["evaluator"] == "calc"
    paths = document["paths"]
    assert set(paths) == {"unary", "batch64", "stream1", "stream64", "data1", "data64"}
    for row in paths.values():
        for mode in ("fresh", "reuse"):
            assert {"p50_us", "p99_us", "items_per_s"} <= set(row[mode])
            assert row[mode]["items_per_s"] > 0
        assert row["fresh_vs_reuse_p50"] > 0
    assert document["targets"]["items_per_s_at_64_fresh_vs_reuse"]["target"] == 0.8
    for mode in ("fresh", "reuse"):
        held = document["memory"][mode]
        assert held["peak_rss_64_calls_bytes"] > 0 and held["calls_during"] > 0


def test_bench_workers_writes_a_row_per_round_caller_count_and_process_count(
    tmp_path: Path,
) -> None:
    out = tmp_path / "workers.json"
    status = evald_main(
        ["bench", "workers", "--seconds", "0.3", "--rounds", "1", "--json", str(out)]
    )
    assert status == 0
    rows = json.loads(out.read_text())
    assert {(r["callers"], r["processes"]) for r in rows} == {(2, 1), (2, 2), (8, 1), (8, 2)}
    assert all(row["items_per_s"] > 0 for row in rows)


def test_bench_host_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    assert evald_main(["bench", "host", "--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    names = " ".join(results)
    for part in ("raw ctypes call", "fresh, pooling allocator", "from the disk cache", "thread"):
        assert part in names, (part, sorted(results))


@pytest.mark.slow  # compiles 1 MiB modules for each phase: about a minute on 2 shared cores
def test_bench_registration_writes_both_variants_and_the_oracle(tmp_path: Path) -> None:
    status = evald_main(
        ["bench", "registration", "--seconds", "0.5", "--rounds", "1", "--out", str(tmp_path)]
    )
    assert status == 0
    result = json.loads((tmp_path / "registration.json").read_text())
    assert set(result["variants"]) == {"in-process", "worker-process"}
    assert result["oracle"]["median_seen_s"] > 0


@pytest.mark.model
def test_bench_mask_fill_prints_a_row_per_evaluator(capsys: pytest.CaptureFixture[str]) -> None:
    assert adapter_main(["bench", "mask-fill", "calc", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("calc")]
    assert len(rows) == 1, rows


def test_a_job_without_its_venv_says_how_to_build_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server benchmarks run from a checkout with the server's venv; elsewhere they say so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVALD_VLLM_PYTHON", raising=False)
    for job in ("vllm-stall", "vllm-forwards"):
        assert adapter_main(["bench", job, "--rounds", "1"]) == 2
        assert "make vllm-venv" in capsys.readouterr().err
