# The two entry points a newcomer needs: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test proto wheel clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 resolves to the local CPU build on these machines; installing it first keeps pip from
	# ever considering a CUDA wheel for the range in pyproject.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/trainguard demo

# Two workers, a test file each at a time (--dist loadfile keeps a file's module fixtures on one worker): most tests
# wait on real processes, sockets and timeouts, so on a 2-core machine the suite takes ~0.65 of its serial time.
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

# Images that set PYTHONDONTWRITEBYTECODE (this one does) made every process the suite starts (launchers, workers,
# CLI calls: thousands) compile trainguard's sources again: about 0.2 s of CPU each.
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

proto: setup
	$(PY) -m trainguard.proto.generate

# A wheel that works without a checkout; it carries the fault trace when $$TRAINGUARD_FAULT_TRACE_DIR or
# ../shared/data/stepfun-fault-trace holds it at build time.
wheel: setup
	$(PY) -m pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info
