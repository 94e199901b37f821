#!/usr/bin/env bash
# s3torchconnector's DCP storage against a local SeaweedFS S3 gateway on 127.0.0.1:
# one row of the compatibility matrix (conformance/matrix/run.py), `make conformance-s3`.
# Writes conformance/reports/matrix/s3torchconnector.{json,md} and updates the matrix.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
exec make -C "$ROOT" conformance-matrix MATRIX_ROWS=s3torchconnector "$@"
