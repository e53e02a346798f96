"""Every benchmark figure the docs quote is the value in a committed results file, formatted as quoted.

    python -m pytest tests/test_docs_figures.py -q

FIGURES is the table: (doc, phrase with `{}` where the figure stands, results file in bench/results/, path
into its JSON, format). The test formats the JSON's value and looks for the phrase, so a rerun of a
benchmark that changes a figure fails here until the doc says the new figure (or the row goes). A doc
figure that no results file holds has no row and does not belong in the docs (issue 30).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT

RESULTS = os.path.join(ROOT, "bench", "results")


def pct(x: float) -> str:
    return f"{x:.1%}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# (doc, phrase, results file, JSON path, format: a format spec or a function of the value)
FIGURES = [
]


def value_at(doc: dict, path: str):
    for key in path.split("."):
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc


def quoted(row) -> str:
    _, phrase, results, path, fmt = row
    with open(os.path.join(RESULTS, results)) as f:
        v = value_at(json.load(f), path)
    return phrase.format(fmt(v) if callable(fmt) else format(v, fmt))


@pytest.mark.parametrize("row", FIGURES, ids=[f"{r[0]}:{r[3]}" for r in FIGURES])
def test_doc_quotes_the_results_file(row):
    with open(os.path.join(ROOT, row[0])) as f:
        text = " ".join(f.read().split())  # a phrase may wrap over lines
    assert quoted(row) in text, f"{row[0]} should say {quoted(row)!r} ({row[2]} {row[3]})"


def test_every_quoted_results_file_names_its_run():
    for results in sorted({r[2] for r in FIGURES}):
        with open(os.path.join(RESULTS, results)) as f:
            p = json.load(f)["provenance"]
        assert p["git_commit"] and p["command"].startswith("python bench/") and not p["git_dirty"], results
