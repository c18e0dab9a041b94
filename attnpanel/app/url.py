"""The whole state in the page URL, and a link's values the state refuses named.

- :func:`apply_each`: Panel's ``Location.sync`` applies a link's values together and, when
  one is refused, drops them all without a word (``?sample=2&corrupted=nonsense`` opened on
  sample 0). Here they are applied one at a time: the others hold, and each refused one is
  named in a notification (and the state's ``last_error``), once: the browser hands the
  link to the server again as it connects. The URL then says what the page shows (it kept
  ``?sample=99`` over a page of sample 0: a copied link reopened on the refusal).
- :class:`HeadsOffInUrl`: the heads switched off, ``?off=2,5`` (absent while every head is
  on). The state's ``enabled_heads`` stays the one truth; this mirrors its complement in
  the URL both ways, so a copied link reopens with the same heads off. A link naming a head
  the layer does not have (or no head number at all) is refused by name and the heads stay
  as they were.
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import panel as pn
import param

from attnpanel.app.scheduler import report
from attnpanel.app.state import ExplorerState

KEY = "off"
WHERE = "reading the link"


def once_loaded(callback, *args) -> None:
    """Run ``callback`` once the browser has loaded the page (a notification sent while it
    is being built never shows)."""
    pn.state.onload(lambda: callback(*args))


def refusal(parameter: param.Parameter, value) -> str:
    """Why ``parameter`` refuses ``value``, in a link's words."""
    if isinstance(parameter, param.Selector):
        choices = ", ".join(str(o) for o in parameter.objects)
        return f"not one of {choices}" if choices else "nothing to choose here"
    if isinstance(parameter, param.Boolean):
        return "not true or false"
    if isinstance(parameter, param.Integer) and not isinstance(value, int):
        return "not a whole number"
    bounds = getattr(parameter, "bounds", None)
    if bounds is not None:
        low, high = bounds
        if low is not None and high is not None:
            return f"outside {low} to {high}"
        return f"below {low}" if low is not None else f"above {high}"
    return "not a value of this parameter"


def apply_each(
    state: ExplorerState,
    mapped: dict,
    arguments: dict[str, str],
    later=None,
    location=None,
    said: set | None = None,
    words: dict[str, dict] | None = None,
) -> None:
    """Apply a link's values (by parameter) one at a time, the layer first (a head is the
    layer's); name each one refused.

    ``arguments`` maps a parameter to its name in the URL; ``later(callback, *args)`` runs
    the notification once the page is loaded (:func:`once_loaded`). A value the state took
    whose consequence failed is named with that failure's own words. With ``location``
    (Panel's ``Location``), the URL then gives the state's own value in place of each one
    refused; with ``said``, a refusal already in it is not named again (it is added).
    ``words`` maps a parameter to its menu's labels and their values: a link may give the
    label a person reads (``stage=raw scores``, ``head=head 3``).
    """
    later = later or (lambda callback, *args: callback(*args))
    refused, kept = [], []
    for name in sorted(mapped, key=lambda name: name != "layer"):
        value = mapped[name]
        labels = (words or {}).get(name, {})
        if isinstance(value, str) and value in labels:
            value = labels[value]  # the menu's words: the URL then gives the value's own
            kept.append(name)
        whole = isinstance(value, float) and value.is_integer()
        if whole and isinstance(state.param[name], param.Integer):
            value = int(value)  # Panel reads "-1" as -1.0 (only digits are integers)
        try:
            state.param.update({name: value})
        except Exception as err:  # noqa: BLE001 - every failure is named, the rest go on
            taken = getattr(state, name, None) == value
            why = str(err) if taken else refusal(state.param[name], value)
            refused.append(f"{arguments.get(name, name)}={value}: {why}")
            if not taken and name not in kept:
                kept.append(name)
    if kept and location is not None:
        later(show_in_url, state, location, {name: arguments.get(name, name) for name in kept})
    new = [said_once for said_once in refused if said is None or said_once not in said]
    if said is not None:
        said.update(new)
    if new:
        later(report, state, ValueError("; ".join(new)), WHERE)


def url_value(parameter: param.Parameter, value) -> str:
    """``value`` as Panel's ``Location.sync`` writes it in a URL."""
    try:
        value = parameter.serialize(value)
    except Exception:  # noqa: BLE001, S110 - Panel writes the value itself then
        pass
    return value if isinstance(value, str) else json.dumps(value)


def show_in_url(state: ExplorerState, location, names: dict[str, str]) -> None:
    """Write the state's values of ``names`` (parameter -> its name in the URL) into the
    URL: what the page shows, in place of a value it refused."""
    location.update_query(
        **{key: url_value(state.param[name], getattr(state, name)) for name, key in names.items()}
    )


class HeadsOffInUrl:
    """Mirror ``state.enabled_heads`` as the URL's ``off`` argument (Panel's ``Location``)."""

    def __init__(self, state: ExplorerState, location, later=None):
        # ``later(callback, *args)``: once the page is loaded; a notification sent while it
        # is being built never shows
        self.state, self.location = state, location
        self.later = later or (lambda callback, *args: callback(*args))

    def start(self) -> None:
        """Read the link's ``off`` into the state, then follow the state."""
        given = self.location.query_params.get(KEY)
        if given not in (None, ""):
            self.apply(str(given))
        self.state.param.watch(self.write, "enabled_heads")
        self.write()

    def apply(self, text: str) -> None:
        """Switch off the heads ``text`` names (``"2,5"``)."""
        heads = list(self.state.param.enabled_heads.objects)
        try:
            off = {int(part) for part in text.split(",") if part.strip()}
        except ValueError:
            off = None
        wrong = None if off is None else sorted(off - set(heads))
        if off is None or wrong:
            named = text if off is None else ", ".join(map(str, wrong))
            last = len(heads) - 1
            message = f"off={text}: {named} is not a head of this layer (heads 0 to {last})"
            self.later(report, self.state, ValueError(message), WHERE)
            return
        self.state.enabled_heads = [h for h in heads if h not in off]

    def write(self, *_events) -> None:
        """The URL's ``off``: the heads not enabled, or no ``off`` at all."""
        heads = self.state.param.enabled_heads.objects
        off = [h for h in heads if h not in set(self.state.enabled_heads)]
        query = {k: v for k, v in self.location.query_params.items() if k != KEY}
        if off:
            query[KEY] = ",".join(map(str, off))
        search = "?" + urlencode(query) if query else ""
        if search != self.location.search:
            self.location.search = search
