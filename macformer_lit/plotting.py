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
    """A fixed colour per label, in order, so every panel of a figure agrees."""
    cycle = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    return {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}


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
    label_suffix: str = "",
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
            label=f"{label}{label_suffix} (n={len(runs)})",
        )
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, linewidth=0)
    if log:
        ax.set_yscale("log")
