"""The ``refdcp`` command line: inspect, verify, trace, conformance, spec, convert, demo (spec/tooling.md)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

__all__ = ["main"]

#: The largest world ``refdcp trace`` accepts: it prints every rank's plan (and
#: ``--format mermaid`` draws every all-gather's world x world messages).
MAX_TRACE_WORLD = 64


def _int_between(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in [lo, hi], else a usage error (exit 2), never a traceback (TOOL-23)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20}
_UNITS["GIB"] = 1 << 30


def _byte_size(text: str) -> int:
    """An argparse ``type``: a positive size, ``123``, ``500MB`` or ``2GiB`` (TOOL-32)."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number) :].upper()
    try:
        value = int(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 1000000, 500MB or 2GiB, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0, else a usage error (exit 2) (TOOL-23)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


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
    world = _int_between(1, MAX_TRACE_WORLD)
    tr.add_argument("--save-world", type=world, default=4, help="ranks that save (1..64)")
    tr.add_argument("--load-world", type=world, default=2, help="ranks that load (1..64)")
    tr.add_argument(
        "--format",
        choices=["text", "mermaid", "markdown"],
        default="text",
        help="text; mermaid: a .mmd sequence diagram; markdown: the diagram in a ```mermaid block",
    )
    tr.add_argument("--no-dedup", action="store_true", help="do not deduplicate replicated items")
    tr.add_argument("--sharding", choices=["rows", "cols", "replicated"], default="rows")
    tr.add_argument(
        "--reference",
        action="store_true",
        help="run refdcp.reference's save and load on a real directory: its planners, "
        "writer and reader, and the files they make (TRACE-14)",
    )
    tr.add_argument(
        "--dir",
        default=None,
        help="with --reference: a new or empty directory to save into, kept afterwards "
        "(default: a temporary directory, removed)",
    )

    conf = sub.add_parser("conformance", help="run the storage conformance suite on a backend")
    conf.add_argument("target", help="module:attribute naming the backend object")
    conf.add_argument("--json", dest="json_path", default=None, help="write the JSON report here")
    conf.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    conf.add_argument(
        "--examples", type=_int_between(1), default=10, help="hypothesis examples per check"
    )
    conf.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        help="seconds per check before it fails (CONF-51)",
    )
    conf.add_argument(
        "--profile",
        choices=["full", "safetensors"],
        default=None,
        help="lay a storage format's profile over the backend's capabilities (CONF-69)",
    )

    sub.add_parser("spec", help="print the requirement -> tests traceability table")

    cv = sub.add_parser(
        "convert",
        help="convert between DCP, torch.save, safetensors and sharded safetensors, "
        "one tensor in memory at a time",
        description="Formats come from the paths: a directory is DCP (sharded safetensors "
        "when it holds a *.safetensors.index.json and no .metadata), .safetensors is "
        "safetensors, a name ending .safetensors.index.json is sharded safetensors with that "
        "index, .pt/.pth/.bin/.ckpt is torch.save; a destination without one of these "
        "extensions is a DCP directory. --from/--to override.",
    )
    cv.add_argument("src", help="checkpoint to read")
    cv.add_argument("dst", help="where to write the converted checkpoint")
    formats = ["dcp", "torch", "safetensors", "safetensors-index"]
    cv.add_argument("--from", dest="src_format", choices=formats, default=None)
    cv.add_argument("--to", dest="dst_format", choices=formats, default=None)
    cv.add_argument(
        "--drop-non-tensors",
        action="store_true",
        help="to safetensors: leave out non-tensor values (listed) instead of refusing",
    )
    cv.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    cv.add_argument(
        "--max-shard-size",
        dest="max_shard_bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="to sharded safetensors: the largest shard (bytes, or with KB/MB/GB/KiB/MiB/GiB; "
        "default 5GB)",
    )

    sub.add_parser(
        "model-check",
        help="explore the protocol tables with faults (options: refdcp model-check -h)",
        add_help=False,
    )

    dm = sub.add_parser(
        "demo", help="the main job on embedded defaults: save, reshard, verify, inspect, conform"
    )
    dm.add_argument("--save-world", type=_int_between(1, 8), default=4, help="1..8 (default 4)")
    dm.add_argument("--load-world", type=_int_between(1, 8), default=3, help="1..8 (default 3)")
    dm.add_argument("--keep", metavar="DIR", default=None, help="work in DIR and keep it")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes are documented in spec/tooling.md (TOOL-12)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["model-check"]:  # its own options (refdcp/tools/model_check.py)
        from refdcp.tools.model_check import main as model_check_main

        return model_check_main(argv[1:])
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
            reference=args.reference,
            directory=args.dir,
        )
    if args.command == "conformance":
        from conformance.cli import conformance_command

        code: int = conformance_command(
            args.target,
            json_path=args.json_path,
            markdown=args.markdown,
            examples=args.examples,
            timeout=args.timeout,
            exit_when_abandoned=True,
            profile=args.profile,
        )
        return code
    if args.command == "convert":
        from refdcp.tools.convert import convert_command

        return convert_command(
            args.src,
            args.dst,
            src_format=args.src_format,
            dst_format=args.dst_format,
            drop_non_tensors=args.drop_non_tensors,
            overwrite=args.overwrite,
            **({} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}),
        )
    if args.command == "demo":
        from refdcp.tools.demo import demo_command

        return demo_command(save_world=args.save_world, load_world=args.load_world, keep=args.keep)
    from refdcp.tools.spec_report import main as spec_main

    return spec_main([])


if __name__ == "__main__":
    sys.exit(main())
