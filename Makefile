# refdcp developer commands.  `make demo` (sets up if needed, then runs the main job) and
# `make test` are all a new machine needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest
TORCH   := torch==2.13.0
WORKERS ?= 2

.PHONY: setup demo test test-thorough test-gpu typecheck lint spec-report bench conformance conformance-s3 clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned and installed first so nothing below can pull a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	touch $(VENV)/.setup-done

# The main job on embedded defaults (refdcp/tools/demo.py): save at 4 fake ranks, load at 3
# with the step-by-step trace, verify, inspect, conformance; non-zero exit if a step fails.
demo: $(VENV)/.setup-done
	$(BIN)/python -m refdcp.tools.demo

# set up only when no completed setup is there
$(VENV)/.setup-done:
	$(MAKE) setup

test:
	HYPOTHESIS_PROFILE=ci $(PYTEST) -n $(WORKERS) -m "not slow and not gpu" -q

test-thorough:
	HYPOTHESIS_PROFILE=thorough $(PYTEST) -n $(WORKERS) -m "not gpu" -q

test-gpu:
	HYPOTHESIS_PROFILE=ci $(PYTEST) -m gpu -v -rs

typecheck:
	$(BIN)/mypy --strict refdcp conformance

lint:
	$(BIN)/ruff check refdcp conformance tests benchmarks
	$(BIN)/ruff format --check refdcp conformance

spec-report:
	$(BIN)/python -m refdcp.tools.spec_report

bench:
	$(BIN)/python -m benchmarks.run $(BENCH)

conformance:
	# every ready-made backend: refdcp's, torch's, the example; writes conformance/reports/
	$(BIN)/python -m conformance.make_reports

conformance-s3:
	# s3torchconnector against a local SeaweedFS S3 gateway on 127.0.0.1
	bash conformance/s3/run.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
