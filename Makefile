# `make demo` and `make test` each set up everything they need on a fresh clone:
# a virtual environment with the CPU build of torch, the test tools, and this
# package compiled in place against that torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml requirements-dev.txt

.PHONY: demo test bench setup clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paged-attention demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/bench_attention.py

clean:
	rm -rf build $(VENV) paged_attention_ext/*.so *.egg-info
