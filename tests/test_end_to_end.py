"""The seam between the halves of the lab: real training runs read back by the analysis."""

import json

import pytest

from analysis.table import load_runs
from lab.commands.cli import run_main

pytestmark = pytest.mark.slow  # launches processes or trains many runs: `make test` only, not test-fast


def test_analysis_reads_real_run_directories(tmp_path, tiny_data_config):
    cfg = tiny_data_config
    data = ["--data.corpus", str(cfg.corpus), "--data.cache_dir", str(cfg.cache_dir),
            "--data.vocab_size", str(cfg.vocab_size)]
    common = ["--model.n_head", "2", "--model.block_size", "32", "--train.batch_tokens", "256",
              "--train.micro_batch", "8", "--train.eval_tokens", "512", "--train.log_every", "2",
              "--train.eval_every", "1"]
    sweep = tmp_path / "sweep"
    summaries = []
    for d in ("16", "32", "48"):
        for tokens in ("512", "1024"):
            run_dir = sweep / f"d{d}-t{tokens}"
            assert run_main([*common, *data, "--model.d_model", d, "--model.n_layer", "1", "--train.tokens", tokens,
                             "--run-dir", str(run_dir)]) == 0
            summaries.append(json.loads((run_dir / "summary.json").read_text()))
    table = load_runs(sweep)
    assert table.params_count == "total" and table.curve_loss == "eval" and len(table.curves) == 6
    read = sorted(table.runs[["params", "tokens", "flops", "loss"]].itertuples(index=False, name=None))
    written = sorted((s["params"], s["tokens"], s["flops"], s["final_eval_loss"]) for s in summaries)
    assert [r[:2] for r in read] == [w[:2] for w in written]
    assert [r[2:] for r in read] == [pytest.approx(w[2:]) for w in written]
