# One command to set up and train the demo, one to set up and test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[dev,deepspeed]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) launch/run.py --config configs/demo.toml --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) launch/bench.py

clean:
	rm -rf $(VENV) runs data/prepared
