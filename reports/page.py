"""Building blocks of a self-contained HTML page: sections, embedded figures, tables.

Figures are rendered by matplotlib's Agg backend to PNG and embedded as base64 data
URIs; the page (`templates/page.html.j2`) inlines its CSS, so a report opens with no
network and no sibling files.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import jinja2  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure as MplFigure  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"


@dataclass
class Figure:
    title: str
    caption: str  # one line: what the figure shows
    png_b64: str


@dataclass
class Section:
    """One report section; `missing` set means it has no data and says why."""

    id: str
    title: str
    intro: str = ""
    figures: list[Figure] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)  # HTML fragments from `html_table`
    notes: list[str] = field(default_factory=list)
    missing: str | None = None
    alert: str | None = None  # a highlighted finding (e.g. the driver was the bottleneck)


def new_figure(width: float = 7.0, height: float = 3.2, ncols: int = 1) -> tuple[MplFigure, list]:
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def render(fig: MplFigure, title: str, caption: str) -> Figure:
    """PNG-encodes and closes a matplotlib figure."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return Figure(title, caption, base64.b64encode(buf.getvalue()).decode("ascii"))


def html_table(df: pd.DataFrame, index: bool = False) -> str:
    """A DataFrame as an HTML table (values escaped, floats with 4 significant digits)."""
    return df.to_html(index=index, classes="tbl", border=0, na_rep="–", float_format=lambda x: f"{x:.4g}")


def guarded(builder: Callable[..., Section], section_id: str, title: str) -> Callable[..., Section]:
    """Wraps a section builder so a failure becomes a section saying so, never a crash."""

    def run(*args: object) -> Section:
        try:
            return builder(*args)
        except Exception as e:  # a bad file must cost one section, not the report
            plt.close("all")
            return Section(
                section_id, title, missing=f"could not render this section: {type(e).__name__}: {e}"
            )

    return run


@dataclass(frozen=True)
class Link:
    """A link in the page's header: `text` then the anchor `label` to `href` (e.g. a page beside it)."""

    text: str
    label: str
    href: str


def render_page(title: str, subtitle: str, sections: list[Section], path: Path, banners: list[str] | None = None,
                links: list[Link] | None = None) -> Path:  # fmt: skip
    """Writes the HTML page with its table of contents and returns the path. `banners`: alerts shown
    above every section, on the first screen (a saturated run, no request within its SLOs); `links`:
    lines in the header under the subtitle (a run report's history page)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    html = env.get_template("page.html.j2").render(
        title=title,
        subtitle=subtitle,
        sections=sections,
        banners=banners or [],
        links=links or [],
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    )
    path.write_text(html, encoding="utf-8")
    return path
