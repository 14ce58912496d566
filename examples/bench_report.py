"""What examples/bench_psum.py and examples/bench_prefill.py print and plot
from a run's document (examples/bench_jobs.py): the line of a cell, the
table of the checks, the latency table, the ratio tables, the summary of
the checks, the plot.

A cell's marks: '!' a result that was not the reference (jax_arx: bit for
bit; jax.lax: within rounding), '?' an algorithm other than the series
asked for ran (or the ranks ran different ones).
"""

from __future__ import annotations

from bench_common import size_label


def cell_mark(check):
    """'' for a cell that checked out; '!' for results that are not the
    reference's bits (or not close to jax.lax's), '?' for an algorithm other
    than the series asked for."""
    if not check:
        return ""
    if not check.get("exact", check.get("close", True)):
        return "!"
    return "" if check.get("as_intended", True) else "?"


def describe_cell(check, us=None):
    """One line of a cell: 'ok, 12.3 us; planned one_shot in 4 pieces, ran one_shot x 4'."""
    mark = cell_mark(check)
    words = ["ok" if not mark else "NOT THE REFERENCE" if mark == "!" else "NOT THE ALGORITHM ASKED FOR"]
    if us is not None:
        words.append(f"{us:.1f} us")
    text = ", ".join(words)
    if "planned" in check:
        p = check["planned"]
        text += f"; planned {p['algorithm']} in {p['pieces']} piece{'s' if p['pieces'] != 1 else ''}"
    if check.get("ran") is not None:
        text += ", ran " + (", ".join(f"{k} x {v}" for k, v in sorted(check["ran"].items())) or "nothing counted")
    if "ran_by_rank" in check:
        text += f" (by rank: {check['ran_by_rank']})"
    return text


def _table(sizes, rows, label_width, cell):
    """A row per (config, series, label) of ``rows``, a column per size;
    ``cell(config, series, size)`` is a cell's text (10 characters at most)."""
    head = f"{'series':<{label_width}}" + "".join(f"{size_label(s):>11}" for s in sizes)
    lines = [head, "-" * len(head)]
    for config, series, label in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"{cell(config, series, s):>11}" for s in sizes))
    return "\n".join(lines)


def _at(doc, part, config, size, series):
    return doc[part].get(config, {}).get(str(size), {}).get(series)


def latency_table(doc, sizes, rows, label_width=30):
    """Per-call us, a row per (config, series, label) of ``rows``; a value
    is followed by its cell's mark ('!', '?')."""

    def cell(config, series, s):
        v = _at(doc, "results", config, s, series)
        return "-" if v is None else f"{v:.1f}{cell_mark(_at(doc, 'checks', config, s, series)) or ' '}"

    return _table(sizes, rows, label_width, cell)


# The algorithms' short names in the check table (stats()' names).
_SHORT = {"ll": "LL", "one_shot": "1-shot", "two_shot": "2-shot", "bulk": "bulk"}


def check_table(doc, sizes, rows, label_width=30):
    """What each cell's check found: the algorithm jax_arx planned and ran
    ('LL', '1-shot/4': in 4 pieces, '2-shot', 'bulk'; 'ok' for jax.lax),
    then the mark ('!', '?'); 'skip' where the cell did not run (the JSON's
    "skipped" says why), '-' where nothing was asked."""

    def cell(config, series, s):
        check = _at(doc, "checks", config, s, series)
        if check is None:
            return "skip" if _at(doc, "skipped", config, s, series) else "-"
        planned = check.get("planned")
        if planned is None:
            text = "ok"
        else:
            text = _SHORT.get(planned["algorithm"], planned["algorithm"])
            if planned["pieces"] > 1 and planned["algorithm"] == "one_shot":
                text += f"/{planned['pieces']}"
        return text + (cell_mark(check) or " ")

    return _table(sizes, rows, label_width, cell)


def ratio_tables(doc, sizes, specs):
    """Each spec (title, (config, series), (config, series), target or
    None): the ratio per size, 'ok' / 'NO' against the target. Returns
    (text, {title: {size: ratio}})."""
    lines, ratios = [], {}
    for title, (nc, ns), (dc, ds), target in specs:
        row, cells = {}, []
        for s in sizes:
            a, b = _at(doc, "results", nc, s, ns), _at(doc, "results", dc, s, ds)
            if a is None or not b:
                cells.append(f"{'-':>11}")
                continue
            row[str(s)] = a / b
            flag = "" if target is None else (" ok" if a / b <= target else " NO")
            cells.append(f"{a / b:>8.2f}{flag:<3}")
        if not row:
            continue
        ratios[title] = row
        lines += [
            "",
            title + (f" (target <= {target})" if target is not None else ""),
            "".join(f"{size_label(s):>11}" for s in sizes),
            "".join(cells),
        ]
    return "\n".join(lines), ratios


def check_summary(doc):
    """Every check of a run: (text, ok). ok is False when a result was not
    the reference's, an algorithm other than the series asked for ran, a
    phase failed or a job did."""
    n, bad = 0, []
    for config, by_size in doc["checks"].items():
        for size, by_series in by_size.items():
            for series, check in by_series.items():
                n += 1
                if cell_mark(check):
                    bad.append(f"{config} {series} {size} B: {check}")
    for config, run in doc["runs"].items():
        bad += [f"{config}: {e}" for e in run.get("errors", [])]
        if run.get("job_failed"):
            bad.append(f"{config}: {run['job_failed']}")
    lines = [f"{n} checks; " + ("every one as it should be" if not bad else f"{len(bad)} problem(s):")]
    lines += [f"  {b}" for b in bad]
    skipped = {c: r["skipped"] for c, r in doc["runs"].items() if "skipped" in r}
    lines += [f"  skipped {c}: {why}" for c, why in skipped.items()]
    return "\n".join(lines), not bad


def plot_latencies(doc, panels, sizes, path, title, xlabel):
    """One log-log panel per (title, [(config, series, label, style)]);
    skipped, saying so, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    for ax, (panel, lines) in zip(axes[0], panels, strict=True):
        for config, series, label, style in lines:
            cells = doc["results"].get(config, {})
            xs = [s for s in sizes if series in cells.get(str(s), {})]
            ax.plot(xs, [cells[str(s)][series] for s in xs], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size_label(s) for s in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("per-call latency (us)")
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)
