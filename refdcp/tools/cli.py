"""The ``refdcp`` command line: inspect, verify, trace, conformance, spec (spec/tooling.md)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refdcp", description="refdcp: reference PyTorch DCP tooling")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="show keys, shapes, chunks, files and commit state")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="machine-readable output")

    ver = sub.add_parser("verify", help="check every item's checksum")
    ver.add_argument("path")
    ver.add_argument("--json", action="store_true")

    tr = sub.add_parser("trace", help="watch a save and a load across fake ranks, step by step")
    tr.add_argument("--save-world", type=int, default=4)
    tr.add_argument("--load-world", type=int, default=2)
    tr.add_argument("--format", choices=["text", "mermaid"], default="text")
    tr.add_argument("--no-dedup", action="store_true", help="do not deduplicate replicated items")
    tr.add_argument("--sharding", choices=["rows", "cols", "replicated"], default="rows")

    conf = sub.add_parser("conformance", help="run the storage conformance suite on a backend")
    conf.add_argument("target", help="module:attribute naming the backend object")
    conf.add_argument("--json", dest="json_path", default=None, help="write the JSON report here")
    conf.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    conf.add_argument("--examples", type=int, default=10, help="hypothesis examples per check")

    sub.add_parser("spec", help="print the requirement -> tests traceability table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes are documented in spec/tooling.md (TOOL-12)."""
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print(f"refdcp {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("REFDCP_DEBUG"):
            raise
        where = getattr(args, "path", None) or getattr(args, "target", None) or ""
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"refdcp {args.command}: {where}{': ' if where else ''}{text}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        from refdcp.tools.inspect import inspect_command

        return inspect_command(args.path, as_json=args.json)
    if args.command == "verify":
        from refdcp.tools.verify import verify_command

        return verify_command(args.path, json=args.json)
    if args.command == "trace":
        from refdcp.tools.trace import trace_command

        return trace_command(
            save_world=args.save_world,
            load_world=args.load_world,
            fmt=args.format,
            dedup=not args.no_dedup,
            sharding=args.sharding,
        )
    if args.command == "conformance":
        from conformance.cli import conformance_command

        code: int = conformance_command(
            args.target, json_path=args.json_path, markdown=args.markdown, examples=args.examples
        )
        return code
    from refdcp.tools.spec_report import main as spec_main

    return spec_main([])


if __name__ == "__main__":
    sys.exit(main())
