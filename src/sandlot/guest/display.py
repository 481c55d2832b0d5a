"""Rich outputs: the display protocol of IPython, in the kernel.

Standard library only, Python >= 3.9 (shipped into every sandbox). An object is shown as a MIME
bundle: ``text/plain`` (its repr) plus whatever its ``_repr_*_`` methods (or
``_repr_mimebundle_``) return; a matplotlib figure becomes a PNG, a pandas DataFrame brings
its own ``_repr_html_``. ``display(obj)`` sends one at once; the value of a cell's last
expression is one too, marked ``is_main_result``; figures left open at the end of a cell (or
passed to ``plt.show()``) are shown and closed, as the notebook's inline backend does.
"""

import io
import sys

from wire import MAX_RESULTS, clip_text, result_cost

# (MIME type, method) in the order IPython's formatters try them.
REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/pdf", "_repr_pdf_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)
BINARY = frozenset({"image/png", "image/jpeg", "application/pdf"})
PLAIN_LIMIT_BYTES = 64 << 10  # a repr kept with a bundle that was too big for the budget
FIGURE_DPI = 100


def _bundle_of_figure(figure):
    import base64

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
    return {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii")}


def _is_figure(obj):
    cls = type(obj)
    return cls.__module__ == "matplotlib.figure" and hasattr(obj, "savefig")


def _normalized(mime, value):
    """The wire form of one format's value, or None to leave the format out."""
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2:
        value = value[0]  # (data, metadata), as _repr_*_ may return
    if mime in BINARY:
        if isinstance(value, (bytes, bytearray)):
            import base64

            return base64.b64encode(bytes(value)).decode("ascii")
        return value if isinstance(value, str) else None  # already base64
    if mime == "application/json":
        import json

        if isinstance(value, (str, bytes)):
            value = json.loads(value)
        json.dumps(value)  # must survive the wire
        return value
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def mime_bundle(obj, plain=None):
    """``{mime: value}`` for ``obj`` (``plain``: its repr, when already made); a broken
    ``_repr_*_`` costs its format, not the cell."""
    data = {} if plain is None else {"text/plain": plain}
    if _is_figure(obj):
        data.update(_bundle_of_figure(obj))
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(obj, type):
        try:
            found = method(include=None, exclude=None)
            if isinstance(found, tuple):
                found = found[0]
            for mime, offered in dict(found or {}).items():
                value = _normalized(str(mime), offered)
                if value is not None:
                    data.setdefault(str(mime), value)
        except Exception as exc:
            _warn("_repr_mimebundle_", exc)
    for mime, name in REPR_METHODS:
        method = getattr(obj, name, None)
        # A class has the methods of its instances: showing the class shows its repr only.
        if mime in data or not callable(method) or isinstance(obj, type):
            continue
        try:
            value = _normalized(mime, method())
        except Exception as exc:
            _warn(name, exc)
            continue
        if value is not None:
            data[mime] = value
    if "text/plain" not in data:
        data["text/plain"] = repr(obj)
    return data


def _warn(method, exc):
    sys.stderr.write("display: %s failed: %s: %s\n" % (method, type(exc).__name__, exc))


class Display:
    """Sends the bundles of one kernel's cells, within a budget per cell: the supervisor's
    measure and count (``wire.Results``)."""

    def __init__(self, send):
        self._send = send  # a bundle dict -> the supervisor
        self._budget = 0
        self._shown = 0
        self._cut = False

    def start_cell(self, budget_bytes):
        self._budget = budget_bytes
        self._shown = 0
        self._cut = False

    def show(self, obj, is_main_result=False, plain=None):
        if self._shown > MAX_RESULTS:
            return  # made for nothing: the supervisor keeps none past the cap
        bundle = {"data": mime_bundle(obj, plain), "is_main_result": is_main_result}
        cost = result_cost(bundle, self._budget)
        if cost > self._budget:
            sys.stderr.write(
                "display: an output costing %d bytes or more was over the cell's remaining %d; "
                "only its text is kept\n" % (cost, max(0, self._budget))
            )
            plain = clip_text(bundle["data"]["text/plain"], PLAIN_LIMIT_BYTES)
            bundle["data"] = {"text/plain": plain}
            cost = result_cost(bundle, self._budget)
            if cost > self._budget and self._cut:
                return  # not even its text fits, and the supervisor knows results were cut
            # Marked, the supervisor says results_truncated. One whose text does not fit
            # either is sent all the same, once, to say so: the supervisor, whose budget is
            # this one, leaves it out.
            bundle["cut"] = True
            self._cut = True
        if cost <= self._budget:
            self._budget -= cost
            self._shown += 1
            if self._shown > MAX_RESULTS:
                # Sent all the same: the supervisor leaves it out and says results_truncated.
                sys.stderr.write(
                    "display: a cell keeps at most %d outputs; later ones are left out\n"
                    % MAX_RESULTS
                )
        self._send(bundle)

    def display(self, *objs, **kwargs):
        """IPython's ``display()``: show each object now, in order."""
        for obj in objs:
            if obj is not None:
                self.show(obj)

    def flush_figures(self):
        """Show and close every open matplotlib figure (only if pyplot was imported)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            numbers = list(pyplot.get_fignums())
        except Exception:
            return
        for number in numbers:
            try:
                self.show(pyplot.figure(number))
            finally:
                pyplot.close(number)


class AfterImport:
    """Runs ``then(module)`` right after the module ``name`` has run, on its first import.

    A finder by its ``find_spec`` alone: subclassing ``importlib.abc.MetaPathFinder`` would
    import ``importlib.abc`` and with it ``importlib.resources`` (pathlib, tempfile, typing,
    zipfile), ~30 ms of CPU in every kernel start, for a base class that adds nothing here.
    Goes first in ``sys.meta_path``, ahead of the finder that would load the module.
    """

    def __init__(self, name, then):
        self._name = name
        self._then = then

    def find_spec(self, name, path=None, target=None):
        if name != self._name:
            return None
        sys.meta_path.remove(self)  # once: the real finders do the finding
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module
        then = self._then

        def exec_module(module):
            run_module(module)
            then(module)

        loader.exec_module = exec_module
        return spec


def pyplot_hook(display):
    """Makes ``plt.show()`` show the open figures as results once pyplot is imported.

    With no display, matplotlib picks its Agg backend, whose ``show()`` only warns that it
    cannot show anything; the function is replaced right after pyplot's own module has run.
    """

    def patch(module):
        def show(*args, **kwargs):
            display.flush_figures()

        module.show = show

    return AfterImport("matplotlib.pyplot", patch)
