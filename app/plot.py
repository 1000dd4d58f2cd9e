"""A small line chart written as PNG with PIL (no plotting library in the install): one curve per
series, a point per measurement. Used by ``glimpse bench --plot`` and ``glimpse eval --plot``."""

from __future__ import annotations

from pathlib import Path

SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")  # what PIL writes a chart as, by the name's suffix
COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def line_plot(series: dict[str, list[tuple[float, float]]], path: str | Path, *, title: str, xlabel: str,
              ylabel: str, xmin: float = 0.0, ymin: float = 0.0) -> None:
    from PIL import Image, ImageDraw

    width, height, pad = 720, 440, 60
    points = [p for values in series.values() for p in values]
    xmax = max([x for x, _ in points] + [xmin + 1e-9]) * 1.1
    ymax = max([y for _, y in points] + [ymin + 1e-9]) * 1.1
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)

    def xy(x, y):
        return (pad + (x - xmin) / (xmax - xmin) * (width - 2 * pad),
                height - pad - (y - ymin) / (ymax - ymin) * (height - 2 * pad))

    draw.line([(pad, pad), (pad, height - pad), (width - pad, height - pad)], fill="black")
    for k in range(5):
        x_value, y_value = xmin + (xmax - xmin) * k / 4, ymin + (ymax - ymin) * k / 4
        x, _ = xy(x_value, ymin)
        _, y = xy(xmin, y_value)
        draw.text((x - 10, height - pad + 6), f"{x_value:.2g}", fill="black")
        draw.text((8, y - 6), f"{y_value:.2g}", fill="black")
    draw.text((width / 2 - 40, height - 24), xlabel, fill="black")
    draw.text((8, 30), ylabel, fill="black")
    draw.text((8, 10), title, fill="black")
    for k, (name, values) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        line = [xy(x, y) for x, y in sorted(values)]
        if len(line) > 1:
            draw.line(line, fill=colour, width=2)
        for x, y in line:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((width - pad - 120, pad + 14 * k), name, fill=colour)
    image.save(path)
