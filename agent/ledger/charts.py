"""The HTML report's charts: matplotlib figures rendered to inline SVG.

Why matplotlib and SVG: the page must open anywhere with no network and no JavaScript, and show
the same picture every time it is rendered from the same ledger. matplotlib draws static
vector graphics with no runtime of its own; its SVG writer escapes every text it writes (labels
are workload names, which users choose); text is drawn as glyph outlines, so a chart looks the
same whatever fonts the viewer has; and with a fixed hash salt and no date in the metadata the
SVG is byte for byte the same from one run to the next.

matplotlib is the optional extra `gpuledger[html]`: it is imported only when a page is asked
for, and its absence is one line naming the extra (`require_matplotlib`).
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from typing import Any

from agent.errors import BadInputError

# Colours people tell apart (matplotlib's tab10), then the fixed ones of time nobody used.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
OTHER_COLOUR = "#7f7f7f"
IDLE_COLOUR = "#c7c7c7"
UNOBSERVED_COLOUR = "#f2f2f2"
WASTE_COLOUR = "#d62728"
USED_COLOUR = "#2ca02c"

# A chart label longer than this is cut (the tables beside the charts show it whole).
LABEL_CHARS = 40
WIDTH_IN = 10.0


def require_matplotlib() -> None:
    """BadInputError (exit 2, one line) where the `html` extra is not installed."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise BadInputError("gpuledger: report --format html needs matplotlib: pip install 'gpuledger[html]'") from None


@dataclass(frozen=True, slots=True)
class Series:
    """One coloured part of a chart: its name (for the legend) and a value per bar."""

    name: str
    values: tuple[float, ...]
    colour: str


def chart_label(text: str) -> str:
    """`text` as matplotlib must be given it to draw it literally: cut to LABEL_CHARS, and `$`
    escaped (a pair of them would otherwise start mathtext, and a lone one in a pod name would
    fail to parse)."""
    if len(text) > LABEL_CHARS:
        text = text[: LABEL_CHARS - 1] + "\N{HORIZONTAL ELLIPSIS}"
    return text.replace("$", r"\$")


def time_bars(starts: Sequence[float], width_s: float, series: Sequence[Series], *, ylabel: str, title: str) -> str:
    """Stacked bars over time, one bar per bucket starting at each of `starts` (Unix seconds)."""
    with _styled():
        return _time_bars(starts, width_s, series, ylabel=ylabel, title=title)


def _time_bars(starts: Sequence[float], width_s: float, series: Sequence[Series], *, ylabel: str, title: str) -> str:
    dates = _module("matplotlib.dates")
    figure, ax = _figure(4.2)
    x = [dates.date2num(datetime.fromtimestamp(t, UTC)) for t in starts]
    width = width_s / 86400.0 * 0.9  # matplotlib dates count days; a small gap between bars
    bottom = [0.0] * len(starts)
    handles = []
    for part in series:
        bars = ax.bar(x, part.values, width=width, bottom=bottom, color=part.colour, align="edge", linewidth=0)
        handles.append((bars, chart_label(part.name)))
        bottom = [b + v for b, v in zip(bottom, part.values, strict=True)]
    locator = dates.AutoDateLocator(tz=UTC)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator, tz=UTC))
    ax.set_ylabel(ylabel)
    _money_axis(ax.yaxis)
    _legend(ax, handles)
    return _svg(figure, title)


def horizontal_bars(
    labels: Sequence[str], series: Sequence[Series], *, xlabel: str, title: str, percent: bool = False
) -> str:
    """Stacked horizontal bars, one per label, the first label at the top."""
    with _styled():
        return _horizontal_bars(labels, series, xlabel=xlabel, title=title, percent=percent)


def _horizontal_bars(labels: Sequence[str], series: Sequence[Series], *, xlabel: str, title: str, percent: bool) -> str:
    figure, ax = _figure(max(1.6, 0.34 * len(labels) + 1.0))
    y = list(range(len(labels)))
    left = [0.0] * len(labels)
    handles = []
    for part in series:
        bars = ax.barh(y, part.values, left=left, color=part.colour, height=0.7, linewidth=0)
        handles.append((bars, chart_label(part.name)))
        left = [a + v for a, v in zip(left, part.values, strict=True)]
    ax.set_yticks(y, [chart_label(label) for label in labels])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if percent:
        ax.xaxis.set_major_formatter(_module("matplotlib.ticker").PercentFormatter(xmax=1.0))
        ax.set_xlim(0, 1)
    else:
        _money_axis(ax.xaxis)
    if len(series) > 1:
        _legend(ax, handles)
    return _svg(figure, title)


def _module(name: str) -> Any:
    return importlib.import_module(name)


# Read when a figure is made and when it is saved: a chart's style is fixed here, whatever the
# user's matplotlibrc says.
_STYLE = {"svg.fonttype": "path", "svg.hashsalt": "gpuledger", "font.size": 9.0, "text.usetex": False}


def _styled() -> Any:
    return _module("matplotlib").rc_context(_STYLE)


def _figure(height_in: float) -> tuple[Any, Any]:
    # Figure itself, not pyplot: no global figure registry, no GUI backend chosen.
    figure = _module("matplotlib.figure").Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
    ax = figure.subplots()
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="both", color="#e5e5e5", linewidth=0.6)
    ax.set_axisbelow(True)
    return figure, ax


def _money_axis(axis: Any) -> None:
    # Each tick gets the decimals all the axis's ticks need: whole dollars would label ticks at
    # $0.50 steps "$0, $0, $1, $2, $2".
    ticker = _module("matplotlib.ticker")
    axis.set_major_formatter(ticker.FuncFormatter(lambda x, _pos: money_tick(x, axis.get_majorticklocs())))


def money_tick(value: float, ticks: Sequence[float]) -> str:
    """`value` in dollars with as many decimals as `ticks`, the axis's tick values, need to show
    each as it is: none for whole dollars, cents where a step is under a dollar, more below a cent."""
    decimals = next((d for d in (0, 2, 3, 4, 5, 6) if all(_whole(t * 10**d) for t in ticks)), 6)
    return f"${value:,.{decimals}f}"


def _whole(scaled: float) -> bool:
    return abs(scaled - round(scaled)) < 1e-6


def _legend(ax: Any, handles: list[tuple[Any, str]]) -> None:
    # Handles and labels given explicitly: matplotlib leaves out of an automatic legend any label
    # that starts with "_", and a workload's name may.
    ax.legend(
        [h for h, _ in handles],
        [label for _, label in handles],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize="small",
    )


def _svg(figure: Any, title: str) -> str:
    """The figure as an <svg> element for inline use: no XML prolog, a title for screen readers."""
    out = io.StringIO()
    figure.savefig(out, format="svg", metadata={"Date": None})
    text = out.getvalue()
    return text[text.index("<svg") :].replace(
        "<svg ", f'<svg class="chart" role="img" aria-label="{escape(title, quote=True)}" ', 1
    )
