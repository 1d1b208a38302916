"""The experiments' shared figure code (matplotlib on the file-only Agg backend): saving, bars
with value labels (single or grouped, log axis), lines with a min/max band, the parameter-drift
panel. A figure's look (fonts, grids, label formats, resolution) is decided here once."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

DRIFT_NETS = (("actor", "tab:blue"), ("critic", "tab:orange"))


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """(figure, axes) as ``plt.subplots`` gives them, on the Agg backend: figures go to
    files, no display is needed (device machines and CI have none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, **kwargs)


def save(fig, path: Path, *, dpi: int = 130, rect: Sequence[float] | None = None) -> None:
    """Lay the figure out (inside ``rect``, figure fractions, if given), write it, close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def finish_axis(ax, xlabel: str, ylabel: str, title: str | None = None, *, log: bool = False, legend: bool = True,
                grid_axis: str = "both") -> None:
    """What every panel sets: labels, title, optional log y, a small legend, a light grid
    (``grid_axis="y"`` for bars: lines across the values only)."""
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if legend:
        ax.legend(fontsize=8)
    ax.grid(axis=grid_axis, alpha=0.3)


def drift_panel(ax, drift: dict, runs: Sequence[tuple[str, str]], reference: str, title: str) -> None:
    """Norm-relative parameter drift per iteration of the actor and the critic of each run in
    ``runs`` ((name, line style), read from ``drift[name][net]``) against ``reference``."""
    for name, style in runs:
        for net, color in DRIFT_NETS:
            ax.plot(drift[name][net], style, color=color, label=f"{name}: {net}")
    finish_axis(ax, "iteration", f"||params - {reference}|| / ||{reference}||", title, log=True)


def line_with_band(ax, x, mean, low, high, label: str, color=None, linestyle="-") -> str:
    """A mean line and its min/max band in the same colour; returns the colour."""
    line = ax.plot(x, mean, color=color, label=label, linestyle=linestyle)[0]
    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    return line.get_color()


def bars(ax, xs, values: Sequence[float], labels: Sequence[str], *, upper: Sequence[float] | None = None,
         width: float = 0.8, color=None, label: str | None = None, fontsize: int = 8, vertical_labels: bool = False):
    """Bars with a text label on each; ``upper``: one-sided whiskers above the bars (e.g. p90
    minus the median). ``vertical_labels`` turns the labels to fit narrow grouped bars."""
    yerr = None if upper is None else [[0.0] * len(upper), list(upper)]
    container = ax.bar(xs, values, width, yerr=yerr, color=color, label=label, capsize=2 if vertical_labels else 3)
    ax.bar_label(container, labels=list(labels), fontsize=fontsize, rotation=90 if vertical_labels else 0,
                 padding=2 if vertical_labels else 0)
    return container


def grouped_bars(ax, groups: Sequence[str], series: Sequence[dict], fmt: Callable[[float], str]) -> None:
    """One bar per series in each group, side by side, labelled with ``fmt(value)``.

    Each series is a dict: ``label``, ``values`` (one per group; None: no bar there), and
    optionally ``upper`` (whiskers, one per group), ``color``, and ``marker`` (drawn on the
    bar's top, to tell series apart in print)."""
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        present = [j for j, v in enumerate(s["values"]) if v is not None]
        xs = [j + offset for j in present]
        ys = [s["values"][j] for j in present]
        upper = [s["upper"][j] for j in present] if s.get("upper") else None
        bars(ax, xs, ys, [fmt(y) for y in ys], upper=upper, width=width, color=s.get("color"), label=s["label"],
             fontsize=7, vertical_labels=True)
        if s.get("marker"):
            ax.scatter(xs, ys, marker=s["marker"], color="black", s=12, zorder=3)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)


def log_value_axis(ax, ylabel: str, *, legend_columns: int = 3) -> None:
    """A log y axis for bars whose values span decades: plain-number ticks, headroom above
    the tallest bar for its vertical value label and the legend, a grid at every tick."""
    import matplotlib.ticker

    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 4)
    ax.legend(ncol=legend_columns, fontsize=8, loc="upper center")
    ax.grid(axis="y", which="both", alpha=0.3)
