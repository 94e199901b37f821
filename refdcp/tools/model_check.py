"""``refdcp model-check``: explore the real protocol tables with faults, print counts (MODEL-6).

For each table and world size it prints the states explored, the ends
reached, the time and the violations; a violation prints its shortest run as
one column per rank. ``--mutants`` judges every single-row mutant of the
tables instead (MODEL-7). Exit 0 when nothing is violated (and every mutant is
killed or listed as equivalent), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

from refdcp.protocol import LOAD, SAVE, Table
from refdcp.protocol.model import FAULT_KINDS, Config, explore
from refdcp.protocol.mutants import equivalence, judge, mutants

__all__ = ["main", "model_check_command", "mutant_command"]

TABLES = {"save": SAVE, "load": LOAD}


def model_check_command(
    tables: list[str], worlds: list[int], max_faults: int, kinds: frozenset[str] = FAULT_KINDS
) -> int:
    """Explore each table at each world size; print one line each and any counterexample."""
    bad = 0
    print(f"{'table':6} {'N':>2} {'K':>2} {'states':>9} {'ends':>8} {'seconds':>8}  violations")
    for name in tables:
        for world in worlds:
            t0 = time.perf_counter()
            result = explore(Config(TABLES[name], world, max_faults, kinds))
            took = time.perf_counter() - t0
            n = len(result.violations)
            print(
                f"{name:6} {world:>2} {max_faults:>2} {result.states:>9} {result.ends:>8} "
                f"{took:>8.2f}  {n}",
                flush=True,
            )
            for violation in result.violations:
                print(violation.table(world))
            bad += n
    return 1 if bad else 0


def mutant_command(tables: list[str]) -> int:
    """Judge every single-row mutant; list survivors that are not known equivalents."""
    unexplained = 0
    for name in tables:
        table: Table = TABLES[name]
        t0 = time.perf_counter()
        total = killed = equivalent = 0
        for m in mutants(table):
            total += 1
            if judge(m, table) is not None:
                killed += 1
                continue
            row = table.rows[m.index]
            if equivalence(table, m) is not None:
                equivalent += 1
                continue
            unexplained += 1
            print(f"SURVIVES {name} row {m.index} ({row.phase} --{row.on.value}--> "
                  f"{row.next}, {row.role.value}): {m.change}")  # fmt: skip
        took = time.perf_counter() - t0
        print(
            f"{name}: {total} mutants, {killed} killed, {equivalent} equivalent, "
            f"{total - killed - equivalent} unexplained ({took:.0f} s)",
            flush=True,
        )
    return 1 if unexplained else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="refdcp model-check", description=__doc__)
    p.add_argument("--table", choices=["save", "load", "both"], default="both")
    p.add_argument("--worlds", default="1,2,3", help="world sizes, e.g. 1,2,3 (default)")
    p.add_argument("--faults", type=int, default=2, help="most faults in one run (default 2)")
    p.add_argument(
        "--kinds", default=",".join(sorted(FAULT_KINDS)), help="fault kinds (default: all)"
    )
    p.add_argument("--mutants", action="store_true", help="judge every single-row mutant")
    args = p.parse_args(argv)
    tables = ["save", "load"] if args.table == "both" else [args.table]
    if args.mutants:
        return mutant_command(tables)
    kinds = frozenset(k for k in args.kinds.split(",") if k)
    unknown = kinds - FAULT_KINDS
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {sorted(FAULT_KINDS)}")
    worlds = [int(w) for w in args.worlds.split(",") if w]
    return model_check_command(tables, worlds, args.faults, kinds)


if __name__ == "__main__":
    sys.exit(main())
