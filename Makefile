# refdcp developer commands.  `make setup` then `make test` is all a new machine needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest
TORCH   := torch==2.13.0
WORKERS ?= 2
MUTATION_SAMPLE ?= 200
MUTATION_SEED   ?= 1
MUTATION_JOBS   ?= 1

.PHONY: setup test test-thorough test-gpu mutation typecheck lint spec-report bench conformance conformance-s3 clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned and installed first so nothing below can pull a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"

test:
	HYPOTHESIS_PROFILE=ci $(PYTEST) -n $(WORKERS) -m "not slow and not gpu" -q

test-thorough:
	HYPOTHESIS_PROFILE=thorough $(PYTEST) -n $(WORKERS) -m "not gpu" -q

test-gpu:
	# fails without usable CUDA (REFDCP_ALLOW_NO_GPU=1 lets it skip) and on any GPU test skipped
	# for a reason other than needing more GPUs (spec/harness.md, HARN-14, HARN-15)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -p refdcp.testing.gpu_gate -m gpu -v -rs

mutation:
	# not part of make test or CI; the default sample took 10-17 minutes on 2 shared cores (tests/MUTATION.md)
	MUTATION_SAMPLE=$(MUTATION_SAMPLE) MUTATION_SEED=$(MUTATION_SEED) MUTATION_JOBS=$(MUTATION_JOBS) \
		$(BIN)/python -m mutation

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
