"""Draw the benchmark figures (PNG) from the JSON the benchmarks write into ``benchmarks/results/``.

* ``planning_scale.png``: coordinator global-plan time and extra peak RSS
  against simulated ranks, refdcp and torch, log-log (``bench_scale``);
* ``phases.png``: µs per item of each save and load step, refdcp (and the
  "before" tree when measured) beside torch's totals (``bench_phases``);
* ``async_blocked.png``: time the caller is blocked in ``async_save``
  against state size for each configuration, with the memcpy of the same
  bytes drawn in (``bench_async``);
* ``read_once.png``: bytes read from storage (in checkpoints) and the modelled
  storage link's busy time against ranks, read-once against reading N times
  (``bench_read_once``).

A figure whose JSON is missing is skipped with a message. Needs matplotlib
(``pip install -e .[bench]``; ``make bench`` installs it).

    .venv/bin/python -m benchmarks.plots [--results benchmarks/results] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(path: str) -> Any:
    if not os.path.exists(path):
        print(f"skip: {path} not found")
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def planning_scale(rows: list[dict[str, Any]], out: str) -> None:
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("fsdp", "-"), ("hsdp", "--")):
        sel = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["ranks"])
        if not sel:
            continue
        ranks = [r["ranks"] for r in sel]
        for impl, color in (("refdcp", "tab:blue"), ("torch", "tab:orange")):
            ax_t.plot(
                ranks,
                [r[f"{impl}_seconds"] for r in sel],
                style,
                color=color,
                marker="o",
                label=f"{impl} {kind}",
            )
            ax_m.plot(
                ranks,
                [max(r[f"{impl}_extra_peak_mib"], 0.1) for r in sel],
                style,
                color=color,
                marker="o",
                label=f"{impl} {kind}",
            )
    for ax, title, unit in (
        (ax_t, "global plan time", "seconds"),
        (ax_m, "coordinator extra peak RSS", "MiB"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks (500 items each)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def phases(data: dict[str, Any], out: str) -> None:
    import matplotlib.pyplot as plt

    med: dict[str, dict[str, float]] = data["medians"]
    items = data["items"]
    labels = [label for label in ("refdcp before", "refdcp") if label in med]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, op in zip(axes, ("save", "load")):
        steps: list[str] = []
        for label in labels:
            for k, v in med[label].items():
                if (
                    k.startswith(f"{op} ")
                    and not k.endswith("total")
                    and v / items * 1e6 >= 0.05
                    and k not in steps
                ):
                    steps.append(k)
        columns = [*labels, "torch"]
        bottom = [0.0] * len(columns)
        for step in steps:
            vals = [med[label].get(step, 0.0) / items * 1e6 for label in labels] + [0.0]
            ax.bar(columns, vals, bottom=bottom, label=step.split(" ", 1)[1])
            bottom = [b + v for b, v in zip(bottom, vals)]
        torch_total = med["torch"][f"{op} total"] / items * 1e6
        ax.bar(["torch"], [torch_total], color="tab:gray", label="torch (whole call)")
        ax.set_ylabel("µs per item")
        ax.set_title(f"{op}: {items} items x {data['bytes']} B")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def async_blocked(data: dict[str, Any], out: str) -> None:
    import matplotlib.pyplot as plt

    rows: list[dict[str, Any]] = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = sorted({r["config"] for r in rows})
    for name in names:
        sel = sorted((r for r in rows if r["config"] == name), key=lambda r: r["gib"])
        ax.plot([r["gib"] for r in sel], [r["blocked_steady"] for r in sel], marker="o", label=name)
    sizes = sorted({r["gib"] for r in rows})
    memcpy = data["memcpy_gib_s"]
    ax.plot(sizes, [g / memcpy for g in sizes], "k--", label=f"memcpy ({memcpy:.1f} GiB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("state size (GiB)")
    ax.set_ylabel("caller blocked, steady state (s)")
    ax.set_title("async_save: blocked time against state size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def read_once(data: dict[str, Any], out: str) -> None:
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for part, marker in (("gloo", "o"), ("modelled", "s")):
        for mode, style in (("read_once", "-"), ("read_n", "--"), ("torch", ":")):
            sel = sorted(
                (r for r in rows if r["part"] == part and r["mode"] == mode),
                key=lambda r: r["ranks"],
            )
            if not sel:
                continue
            ranks = [r["ranks"] for r in sel]
            read = [
                (r["bytes_total"] if "bytes_total" in r else sum(r["bytes_per_rank"]))
                / r["checkpoint_bytes"]
                for r in sel
            ]
            ax_b.plot(ranks, read, style, marker=marker, label=f"{part} {mode}")
            if part == "modelled":
                busy = [r["link_busy_s"] for r in sel]
                ax_t.plot(ranks, busy, style, marker=marker, label=f"{mode} (link busy)")
    ax_b.set_xscale("log", base=2)
    ax_b.set_yscale("log", base=2)
    ax_b.set_xlabel("ranks")
    ax_b.set_ylabel("bytes read from storage / checkpoint bytes")
    ax_b.legend(fontsize=7)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("ranks (FakeWorld, modelled shared storage)")
    ax_t.set_ylabel("modelled storage time, s")
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    scale = _load(os.path.join(args.results, "scale.json"))
    if scale:
        planning_scale(scale, os.path.join(args.out, "planning_scale.png"))
    ph = _load(os.path.join(args.results, "phases.json"))
    if ph:
        phases(ph, os.path.join(args.out, "phases.png"))
    asy = _load(os.path.join(args.results, "async.json"))
    if asy:
        async_blocked(asy, os.path.join(args.out, "async_blocked.png"))
    once = _load(os.path.join(args.results, "read_once.json"))
    if once:
        read_once(once, os.path.join(args.out, "read_once.png"))


if __name__ == "__main__":
    main()
