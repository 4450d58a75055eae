"""--exclude conditions are a small grammar on the columns, never evaluated as Python (issue 32)."""

import re

import numpy as np
import pandas as pd
import pytest

from analysis.conditions import ConditionError, evaluate
from analysis.table import InputError, load_runs

FRAME = pd.DataFrame({"params": [1e6, 2e7, 3e8], "tokens": [1e9, 2e9, 3e9], "role": ["fit", "verify", "fit"]})


@pytest.mark.parametrize("text, rows", [
    ("params < 1e7", [True, False, False]),
    ("params >= 2e7 and role == 'fit'", [False, False, True]),
    ("role == \"verify\" or params<1e7", [True, True, False]),
    ("not (params > 1e7 & tokens != 3e9)", [True, False, True]),
    ("(params == 1e6) | (tokens == 3e9)", [True, False, True]),
])
def test_columns_numbers_text_comparisons_and_or_not(text, rows):
    assert evaluate(text, FRAME).tolist() == rows


@pytest.mark.parametrize("text, message", [
    ("params.abs() > 0", "unexpected '.abs() > 0'"),
    ("__import__('os').system('true')", "unexpected \".system('true')\""),
    ("__import__ == 1", "no column named '__import__'"),
    ("params > @x", "unexpected '@x'"),
    ("params + 1 > 0", "unexpected '+ 1 > 0'"),
    ("(params > 0", "a '(' is not closed"),
    ("params >", "the condition ends too soon"),
    ("params > 0 tokens", "unexpected 'tokens'"),
])
def test_anything_beyond_the_grammar_is_refused(text, message):
    with pytest.raises(ConditionError, match=re.escape(message)):
        evaluate(text, FRAME)


def test_exclude_refuses_method_calls_that_pandas_eval_ran(tmp_path):
    path = tmp_path / "runs.csv"
    pd.DataFrame({"run_id": list("abcdefgh"), "params": [1e6 * 2**i for i in range(8)],
                  "tokens": [2e9 * 3**(i % 3) for i in range(8)],
                  "loss": [3.0 - 0.1 * i for i in range(8)]}).to_csv(path, index=False)
    assert [d["run_id"] for d in load_runs(path, exclude=["params < 3e6"]).dropped] == ["a", "b"]
    with pytest.raises(InputError, match="it is not a condition on the columns"):
        load_runs(path, exclude=["params.abs() > 0"])
    assert np.array_equal(evaluate("run_id == 'b'", pd.read_csv(path)), [i == 1 for i in range(8)])
