"""The throughput benchmark runs and reports sane figures (speed itself is not asserted)."""

import json

from lab.bench import main


def test_benchmark_script_runs_and_reports_mfu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["model"] for r in results} == {"tiny", "tiny-modern"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in results)
    assert "tiny-modern" in capsys.readouterr().out


def test_benchmark_rejects_bad_arguments(capsys):
    assert main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
