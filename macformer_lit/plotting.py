"""Curves over seeds, shared by ``report`` and ``sweep``: one colour per setting, the mean
over its runs as a line and their min–max as a shaded band.

A run's curve is a list of ``(x, y)`` points (step or epoch, value). At each x the mean,
min and max are taken over the runs that logged that x, so a run cut short narrows the
band rather than bending the mean towards zero.
"""

from __future__ import annotations

import math

Series = list[tuple[float, float]]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colours_for(labels: list[str]) -> dict[str, str]:
    """A fixed colour per label, in order, so every panel of a figure agrees, and no two labels
    share one: matplotlib's ten default colours first (a figure of up to ten labels keeps
    them), then the light variant of each (tab20), then tab20b's and tab20c's, then evenly
    spaced hues for any beyond those 50."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    palette = [to_hex(c) for c in pyplot().rcParams["axes.prop_cycle"].by_key()["color"]]
    extra = list(colormaps["tab20"].colors[1::2])
    extra += list(colormaps["tab20b"].colors) + list(colormaps["tab20c"].colors)
    palette += [c for c in map(to_hex, extra) if c not in palette]
    more = len(labels) - len(palette)
    if more > 0:
        palette += [to_hex(colormaps["hsv"](i / more)) for i in range(more)]
    return {label: palette[i] for i, label in enumerate(labels)}


def legend_below(fig, axes, *, ncol: int = 2) -> None:
    """One legend for the whole figure, under its panels, so that no legend covers a curve:
    every label once, in the order the panels first show it. The figure must have been made
    with ``layout="constrained"``. Columns are dropped (down to one) until the legend fits the
    figure's width, which grows if even one column does not; the figure grows by the legend's
    height, so the panels keep theirs.
    """
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if not entries:
        return
    renderer = fig.canvas.get_renderer()
    for cols in range(max(1, min(ncol, len(entries))), 0, -1):
        legend = fig.legend(
            list(entries.values()),
            list(entries),
            loc="outside lower center",
            ncol=cols,
            fontsize="small",
            frameon=False,
        )
        box = legend.get_window_extent(renderer)
        if box.width <= fig.bbox.width or cols == 1:
            break
        legend.remove()
    if box.width > fig.bbox.width:
        fig.set_figwidth(box.width / fig.dpi + 0.2)
    fig.set_figheight(fig.get_figheight() + box.height / fig.dpi + 0.1)


def mean_band(
    runs: list[Series], *, positive: bool = False
) -> tuple[list[float], list[float], list[float], list[float]]:
    """``x, mean, min, max`` over ``runs`` at every x any of them logged; non-finite values
    (and, for a log axis, ``positive=True``, values <= 0) are left out."""
    at: dict[float, list[float]] = {}
    for run in runs:
        for x, y in run:
            if math.isfinite(y) and (y > 0 or not positive):
                at.setdefault(x, []).append(y)
    xs = sorted(at)
    return (
        xs,
        [sum(at[x]) / len(at[x]) for x in xs],
        [min(at[x]) for x in xs],
        [max(at[x]) for x in xs],
    )


def plot_bands(
    ax,
    curves: dict[str, list[Series]],
    *,
    colours: dict[str, str],
    linestyles: dict[str, str] | None = None,
    log: bool = False,
) -> None:
    """Per label of ``curves``: the mean of its runs as a line (legend: label and number of
    runs), the min–max over them as a band where it has more than one run."""
    for label, runs in curves.items():
        runs = [r for r in runs if r]
        xs, mean, lo, hi = mean_band(runs, positive=log)
        if not xs:
            continue
        colour = colours[label]
        ax.plot(
            xs,
            mean,
            color=colour,
            linestyle=(linestyles or {}).get(label, "-"),
            marker="o",
            markersize=3,
            label=f"{label} (n={len(runs)})",
        )
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, linewidth=0)
    if log:
        ax.set_yscale("log")
