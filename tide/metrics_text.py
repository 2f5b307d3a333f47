"""Reading a ``/metrics`` page (Prometheus exposition text), defined once, over prometheus_client's parser.

Every reader of an engine's, SGLang's or a service's ``/metrics`` goes through ``parse``; none splits
lines by hand. Names follow the parser: a counter's family is its name without ``_total`` (its
sample keeps it, and its ``_created`` sample is a family of its own), a histogram's family holds its
``_bucket``, ``_count`` and ``_sum`` samples. ``by_label`` sums one sample name by one label, which
is how acceptance is read back (the accept-length histogram's ``_sum`` and ``_count`` by drafter
version), summed over the processes that export the same series (SGLang's schedulers).
"""
from __future__ import annotations

from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Families = dict[str, list[Sample]]


class MetricsTextError(ValueError):
    """Text the Prometheus parser rejects (a malformed line): nothing of it is returned."""


def parse(text: str, prefix: str = "") -> Families:
    """{family name: its samples} of ``text``, the families whose name starts with ``prefix``; a
    family that appears more than once (untyped samples) is merged. MetricsTextError on bad text."""
    out: Families = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name.startswith(prefix):
                out.setdefault(family.name, []).extend(family.samples)
    except ValueError as exc:
        raise MetricsTextError(f"not Prometheus exposition text: {exc}") from None
    return out


def by_label(families: Mapping[str, list[Sample]], sample_name: str, label: str) -> dict[str, float]:
    """Sum of the samples named ``sample_name`` (e.g. ``x_total``, ``h_sum``) by their ``label``
    value; samples without that label are left out, and a name that is absent gives {}."""
    out: dict[str, float] = {}
    for samples in families.values():
        for s in samples:
            if s.name == sample_name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out
