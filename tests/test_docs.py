"""The README stays a user's page (issue 34: at most 300 lines), and the documents' relative links lead somewhere."""

import os
import re

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md", "BENCHMARKS.md", "docs/experiments.md", "benchmarks/README.md", "data/README.md"]


def test_the_readme_is_at_most_300_lines():
    with open(os.path.join(ROOT, "README.md")) as handle:
        assert len(handle.read().splitlines()) <= 300


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_of_a_document_exists(document):
    path = os.path.join(ROOT, document)
    with open(path) as handle:
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", handle.read())
    missing = [
        link
        for link in links
        if "://" not in link and not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), link)))
    ]
    assert not missing, f"{document} links to {missing}"
