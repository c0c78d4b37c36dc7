"""Figures that cannot drift (issue 34; no server needed): every measured
figure the README's Performance section and docs/performance.md quote is
in a results file `scripts/bench` (or a bench script) wrote, one that the
text cites.

A figure is a ratio (`1.27×`, `0.88 (0.84–0.97)`), a count with thousands
separators (`83,347` instructions) or a latency (`118 ms`); a goal
(`≤ 1.25×`, `< 0.5 ms`) is not a figure. It must equal,
to the digits it shows, a number of a results file cited by its sentence,
its paragraph or its section (`bench/results/….md`). A figure of an
earlier release or commit says so in its sentence (`0.3.0`, `b72fcbf`):
it is history, not a measurement of this code, and is not checked.
"""

import glob
import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))

NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
FIGURE = re.compile(r"(?<![<>≤≥\d.,])(?<![<>≤≥] )(?:(\d+\.\d+)\s*(?:[×x](?!\w)|\s*\(\d)|(\d{1,3}(?:,\d{3})+)|(\d+(?:\.\d+)?)\s*ms\b)")
# The earlier members of `0.753 / 1.076 / 1.111×` and of `1.16–1.33×`.
SERIES = re.compile(r"(?<![<>≤≥\d.,])((?:\d+\.\d+\s*(?:/|–)\s*)+)\d+\.\d+\s*[×x](?!\w)")
CITATION = re.compile(r"bench/results/([\w.-]+\.md)")
HISTORY = re.compile(r"\b0\.[0-3]\.0\b|\b[0-9a-f]{7,40}\b")


def results_numbers():
    """{results file name: [(text, value)]} of bench/results/."""
    found = {}
    for path in glob.glob(os.path.join(ROOT, "bench", "results", "*.md")):
        numbers = []
        for m in NUMBER.finditer(open(path).read()):
            text = m.group(0).replace(",", "")
            numbers.append((text, float(text)))
        found[os.path.basename(path)] = numbers
    return found


def decimals(text):
    return len(text.split(".")[1]) if "." in text else 0


def in_results(figure, files, numbers):
    """Whether `figure` is a number of one of `files`, to its digits."""
    text = figure.replace(",", "")
    value, places = float(text), decimals(text)
    return any(decimals(t) >= places and round(v, places) == value
               for f in files for t, v in numbers[f])


def figures_in(text):
    """The figures of `text`, in order."""
    found = [next(g for g in m.groups() if g) for m in FIGURE.finditer(text)]
    for m in SERIES.finditer(text):
        found += re.findall(r"\d+\.\d+", m.group(1))
    return found


def quoted_texts():
    readme = open(os.path.join(ROOT, "README.md")).read()
    performance = readme.split("\n## Performance", 1)[1].split("\n## ", 1)[0]
    return {"README.md, Performance": performance,
            "docs/performance.md": open(os.path.join(ROOT, "docs", "performance.md")).read()}


def unchecked_figures(texts, numbers):
    """(where, figure, sentence) of every figure not in a results file its
    sentence, paragraph or section cites."""
    bad = []
    for where, text in texts.items():
        for section in re.split(r"\n(?=#{2,4} )", text):
            section_cites = CITATION.findall(section)
            for paragraph in re.split(r"\n\s*\n", section):
                if paragraph.lstrip().startswith("|"):
                    units = paragraph.splitlines()
                else:
                    units = re.split(r"(?<=[.;])\s+(?=[A-Z(`*-])", paragraph)
                for unit in units:
                    if HISTORY.search(unit):
                        continue
                    cites = [c for c in CITATION.findall(unit) + CITATION.findall(paragraph) + section_cites
                             if c in numbers]
                    for figure in figures_in(unit):
                        if not in_results(figure, cites, numbers):
                            bad.append((where, figure, " ".join(unit.split())[:160]))
    return bad


def test_every_quoted_figure_is_in_a_results_file_it_cites():
    numbers = results_numbers()
    assert len(numbers) >= 8, "the results files were read"
    texts = quoted_texts()
    assert sum(len(FIGURE.findall(t)) for t in texts.values()) > 100, "the figures were found"
    bad = unchecked_figures(texts, numbers)
    assert not bad, f"{len(bad)} figures are in no results file their text cites:\n" + "\n".join(
        f"{where}: {figure} in “{sentence}”" for where, figure, sentence in bad)


def test_the_figure_check_sees_a_stale_figure():
    """The check above fails where it should: a figure its cited file does
    not have, or one citing no file at all, is reported; history is not."""
    numbers = {"a.md": [("1.272", 1.272), ("83347", 83347.0)]}
    texts = {"t": "From bench/results/a.md: ack 1.27× (83,347 instructions), 1.27 / 1.20×.\n\n"
                  "## Other\n\nack 1.33× Synapse's UPDATE.\n\n"
                  "## Old\n\n0.3.0's ack was 3.36× (bench/results/a.md)."}
    assert [figure for _, figure, _ in unchecked_figures(texts, numbers)] == ["1.20", "1.33"]
