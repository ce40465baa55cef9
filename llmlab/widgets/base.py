"""What every chapter's explorer shares: the live view over a pure function, its static fallback, number labels.

An explorer is a set of controls in front of a pure function. `explorer(controls, render)` builds the view every
chapter uses: the controls, a result line and (optionally) a plot, recomputed whenever a control moves, and a
display that also carries the current result as static output (plain text and a PNG) next to the widget view.
JupyterLab shows the live widget; a headless run, nbconvert or a rendered page without widget state shows the
static result instead. ipywidgets is imported only when an explorer is built, never by `import llmlab`.

`result_explorer(controls, current, describe, draw)` is the usual case: one result computed from the controls,
shown as a line of text and a figure.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable

from llmlab.hardware import SPECS

__all__ = ["png", "explorer", "result_explorer", "gpu_spec", "si", "count", "ibytes", "choices"]


CSS_DPI, SCALE = 80, 2  # a figure is shown at 80 CSS px per inch, drawn with 2 device pixels per CSS pixel


def png(fig) -> bytes:
    """A matplotlib Figure as PNG bytes, drawn at SCALE × CSS_DPI (160 dpi): sharp on a high-density screen
    when shown at :func:`css_width`, and 30 ms more to draw than at 80 dpi."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=CSS_DPI * SCALE)
    return buf.getvalue()


def css_width(fig) -> int:
    """The width in CSS pixels that a figure drawn by :func:`png` is shown at (never stretched to its box)."""
    return round(fig.get_figwidth() * CSS_DPI)


def _box_class():
    """A VBox whose display carries a static fallback (plain text, optionally a PNG) next to the widget view."""
    import ipywidgets  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    class Explorer(ipywidgets.VBox):
        def _static(self) -> dict:  # set by `explorer`: mimetype -> data of the current result
            return {}

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data.update(self._static())
            width = self._static_width()
            return (data, {"image/png": {"width": width}}) if width and "image/png" in data else data

        def _static_width(self) -> int:  # set by `explorer`: the CSS width of the static PNG
            return 0

    return Explorer


def explorer(controls: dict, render: Callable, *, layout=None, plot: bool = True, preformatted: bool = False,
             handlers: dict[str, Callable] | None = None, refused: str = "cannot compute this setting"):
    """The live view of `render` over `controls` (argument name → ipywidget).

    `render(change)` reads the controls and returns `(text, figure)`; `change` is the traitlets change that
    triggered it (None for the first draw). The text is shown in bold (or preformatted) and is the static
    text/plain; a figure (matplotlib) replaces the plot, None keeps the last one (a cheap redraw). A ValueError
    from `render` (a setting the function refuses) is shown as ``f"{refused}: {error}"`` and the last plot kept.
    `handlers` maps a control's name to `fn(change, update)` observing it instead of `update` (e.g. a link whose
    choice moves another slider). `layout` replaces the controls' plain column (a list of widgets). The result
    has `.controls`, `.result` (HTML), `.plot` (Image, when `plot`) and `.update()`.
    """
    import ipywidgets as w  # only when a widget is built: `import llmlab.widgets` loads no Jupyter

    result, image = w.HTML(), w.Image(format="png", layout=w.Layout(max_width="100%", height="auto",
                                                                   align_self="flex-start"))
    state = {"text": "", "png": b"", "width": 0}

    def update(change=None) -> None:
        try:
            text, fig = render(change)
        except ValueError as e:
            text, fig = f"{refused}: {e}", None
        state["text"] = text
        if fig is not None:
            state["png"], state["width"] = png(fig), css_width(fig)
            image.value = state["png"]
            image.layout.width = f"{state['width']}px"  # its own size, not the box's (a stretched PNG blurs)
        shown = html.escape(text, quote=False)
        result.value = f"<pre>{shown}</pre>" if preformatted else f"<b>{shown}</b>"

    for name, c in controls.items():
        handler = (handlers or {}).get(name)
        c.observe((lambda change, h=handler: h(change, update)) if handler else update, names="value")
    update()
    box = _box_class()([*(layout or controls.values()), result, *([image] if plot else [])])
    box.controls, box.result, box.update = controls, result, update
    if plot:
        box.plot = image
        box._static = lambda: {"text/plain": state["text"], "image/png": base64.b64encode(state["png"]).decode()}
        box._static_width = lambda: state["width"]
    else:
        box._static = lambda: {"text/plain": state["text"]}
    return box


def result_explorer(controls: dict, current: Callable[[], object], describe: Callable[[object], str],
                    draw: Callable | None = None, *, on_release: bool = False, **kwargs):
    """`explorer` over one result: `current()` computes it from the controls, `describe(result)` is the text and
    `draw(result)` the figure (None: text only). `on_release`: sliders recompute once released, not while dragged
    (for a result that takes a while). Other keywords go to `explorer`; the caller keeps `current` to expose it."""
    if on_release:
        for c in controls.values():
            c.continuous_update = False

    def render(change):
        result = current()
        return describe(result), None if draw is None else draw(result)

    return explorer(controls, render, plot=draw is not None, **kwargs)


def gpu_spec(gpu: str):
    """The spec sheet's row for `gpu` (`llmlab.hardware.SPECS`), or a ValueError naming the choices."""

    if gpu not in SPECS:
        raise ValueError(f"gpu={gpu!r} is not on the spec sheet; choose from {', '.join(SPECS)}")
    return SPECS[gpu]


def si(x: float, unit: str = "") -> str:
    """3 significant digits with an SI prefix: 1.75e11 → '175 G'."""
    if x == 0:
        return f"0 {unit}".rstrip()
    exp = max(-4, min(8, int(math.floor(math.log10(abs(x)) / 3))))
    prefix = {-4: "p", -3: "n", -2: "µ", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T", 5: "P", 6: "E", 7: "Z",
              8: "Y"}[exp]
    return f"{x / 10 ** (3 * exp):.3g} {prefix}{unit}".rstrip()


def count(x: float) -> str:
    """A large count the way model cards write it: 175e9 → '175B', 1.4e12 → '1.4T'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def ibytes(x: float) -> str:
    """Bytes with a binary prefix, 3 significant digits: 1024 → '1 KiB', 14e9 → '13 GiB'."""
    for power, prefix in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(x) >= 1024**power:
            return f"{x / 1024**power:.3g} {prefix}"
    return f"{x:.3g} B"


def choices(default, exponents, label, mantissas=(1, 2, 5), base=10) -> list[tuple[str, float]]:
    """Slider stops m·base^e (a log scale of round numbers) with `default` among them, as (label, value) pairs.

    A selection slider holds exactly these values: a log slider would snap 175e9 to its own grid as soon as the
    browser renders it, and the result shown would no longer be the default's.
    """
    values = {m * base**e for e in exponents for m in mantissas} | {default}
    return [(label(v), v) for v in sorted(values)]
