"""Conformance of ``s3torchconnector``'s DCP storage against a local S3 server (run.sh)."""
