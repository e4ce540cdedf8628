"""Read Prometheus text (``/metrics``): one reader for tests and benchmarks alike.

:func:`metric_value` picks one sample by name and label fragments,
:func:`samples` parses every sample, :func:`series_sum` adds a metric's series
up, and :func:`scrape` / :func:`scrape_value` fetch ``URL/metrics`` first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import httpx


def samples(text: str) -> dict[str, float]:
    """Every sample of Prometheus ``text``, keyed by ``name{labels}`` as written (comments skipped)."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and " " in line:
            key, value = line.rsplit(" ", 1)
            found[key] = float(value)
    return found


def _name_and_labels(key: str) -> tuple[str, str]:
    name, _, labels = key.partition("{")
    return name, labels


@overload
def metric_value(text: str, name: str, labels: str = "", default: float = 0.0) -> float: ...
@overload
def metric_value(text: str, name: str, labels: str, default: None) -> float | None: ...
@overload
def metric_value(text: str, name: str, labels: str = "", *, default: None) -> float | None: ...


def metric_value(text: str, name: str, labels: str = "", default: float | None = 0.0) -> float | None:
    """The first sample of metric ``name`` in Prometheus ``text`` whose labels hold every comma-separated part
    of ``labels`` (e.g. ``'model="tiny",code="200"'``); ``default`` when there is none (an absent counter is 0)."""
    return next(_matching(samples(text), name, labels), default)


def _matching(parsed: dict[str, float], name: str, labels: str):
    """The values of the samples of metric ``name`` whose labels hold every comma-separated part of ``labels``."""
    parts = [part for part in labels.split(",") if part]
    for key, value in parsed.items():
        sample_name, sample_labels = _name_and_labels(key)
        if sample_name == name and all(part in sample_labels for part in parts):
            yield value


def series_sum(text_or_samples: str | dict[str, float], name: str, labels: str = "") -> float:
    """The sum of every series of metric ``name`` whose labels hold every comma-separated part of ``labels``
    (``text_or_samples``: Prometheus text, or :func:`samples` of it)."""
    parsed = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return sum(_matching(parsed, name, labels))


async def scrape(url: str, client: httpx.AsyncClient | None = None) -> str:
    """The Prometheus text at ``url`` + ``/metrics`` (``url`` is a gateway's control URL or an engine's URL)."""
    if client is not None:
        return (await client.get(url + "/metrics")).text
    import httpx  # the test extra's; the text functions above need nothing

    async with httpx.AsyncClient(timeout=10) as own:
        return (await own.get(url + "/metrics")).text


async def scrape_value(url: str, name: str, labels: str = "", *, default: float | None = None,
                       client: httpx.AsyncClient | None = None) -> float | None:
    """:func:`metric_value` of the metrics at ``url``; ``default`` (None: a test can tell "absent" from 0) when
    there is no such sample."""
    return metric_value(await scrape(url, client), name, labels, default)
