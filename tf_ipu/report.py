"""Reports as self-contained HTML pages (inline SVG, no external assets).

One renderer for every report the project makes (``device_server.emulator.tiles.html``):
``tf_ipu.estimate(...)`` results, the compile reports of ``strategy.reports`` (the estimate
the device server attached to each compile), or their JSON parsed back into a dict.

    tf_ipu.report.save_html(tf_ipu.estimate(model, 8), "model.html")
    tf_ipu.report.save_html(strategy.reports[-1], "train_step.html")
"""

from __future__ import annotations

from typing import Any

from device_server.emulator.tiles.html import render_html as _render

__all__ = ["render_html", "save_html", "to_report_dict"]


def to_report_dict(report: Any) -> dict[str, Any]:
    """The plain report dict of an ``Estimate``, a ``CompileReport`` or a dict.

    Raises:
        ValueError: for anything else, or a compile report without the full estimate.
    """
    if isinstance(report, dict):
        return report
    details = getattr(report, "details", None)
    if isinstance(details, dict):  # runtime.CompileReport: the server's full estimate
        if not details:
            raise ValueError(f"the compile report of {getattr(report, 'name', '?')!r} carries no "
                             "full estimate (the server sent no JSON report).")
        d = dict(details)
        d.setdefault("program", getattr(report, "name", ""))
        return d
    if hasattr(report, "to_dict"):
        return report.to_dict()
    raise ValueError(f"cannot make a report of {type(report).__name__}: expected an Estimate, a "
                     "CompileReport or a dict.")


def render_html(report: Any) -> str:
    """The HTML page of ``report`` (see :func:`to_report_dict`)."""
    return _render(to_report_dict(report))


def save_html(report: Any, path: str) -> str:
    """Writes the HTML page of ``report`` to ``path``; returns the path."""
    import os

    text = render_html(report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
