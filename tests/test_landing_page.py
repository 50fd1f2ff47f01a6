"""The landing page answers each learner's question fast: every one of the nine questions of
``READER_QUESTIONS`` gets a one-sentence answer, linked to its proof, before the reader has
read 150 words of the page, and the whole "Find your question" list fits in its first 250.

Words are counted as a reader meets them in ``intro.md``: the title and every word before
the answer, the question's bold label included; a link counts its text, inline math its
symbols (``$n \\times d_v$`` is three). Markup (``**``, backticks, roles) is not read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTRO = ROOT / "intro.md"

# The bold label of each of the nine questions (Q1 to Q9), as the list writes it. Q1's label asks
# its first half; its answer also says that projecting once and splitting is the per-head projection.
NINE = ("Q, K, V: one matrix or three?", "Shapes?", "Why two matrices?", "Key or value?",
        r"Why divide by $\sqrt{d_k}$?", "Why several heads?", "What is $W^O$ for?",
        "Self, cross or causal?", "FlashAttention?")


def words(markdown: str) -> list[str]:
    """The words a reader sees in ``markdown`` (see the module's docstring)."""
    text = re.sub(r"\{ref\}`([^`<]*?)\s*<[^>]*>`", r"\1", markdown)  # link text only
    text = re.sub(r"\{(?:ref|doc)\}`[^`]*`", "section", text)  # a bare reference: one word
    seen: list[str] = []
    for part in re.split(r"(\$[^$]+\$)", text):
        if part.startswith("$"):
            seen += part.strip("$").split()
        else:
            seen += [w for w in re.sub(r"[*#`|]", " ", part).split() if re.search(r"\w", w)]
    return seen


def in_short() -> tuple[list[tuple[str, str, int]], int]:
    """The list under "Find your question": (label, answer, words before the answer) per
    item, and the words read when the list ends."""
    text = INTRO.read_text()
    top, rest = text.split("## Find your question", 1)
    block = rest.split("\n\n", 2)[1]  # the list: the first paragraph after the heading
    read = len(words(top)) + len(words("Find your question"))
    items = []
    for item in re.split(r"\n(?=- )", block.strip()):
        m = re.fullmatch(r"- \*\*(.+?)\*\*\s+(.*)", item, re.S)
        assert m, f"not a '- **question** answer' item: {item[:60]!r}"
        label, answer = m[1], " ".join(m[2].split())
        items.append((label, answer, read + len(words(label))))
        read += len(words(item))
    return items, read


def test_each_of_the_nine_questions_is_answered_within_150_words() -> None:
    items, _ = in_short()
    before = {label: n for label, _, n in items}
    assert set(NINE) <= set(before), f"missing from the list: {set(NINE) - set(before)}"
    late = {q: before[q] for q in NINE if before[q] > 150}
    assert not late, f"answered after more than 150 words: {late}"


def test_the_list_fits_in_the_first_250_words_one_linked_sentence_each() -> None:
    items, read = in_short()
    assert read <= 250, f"the list ends after {read} words"
    for label, answer, _ in items:
        assert "{ref}`" in answer, f"{label}: no link to its proof"
        prose = re.sub(r"\$[^$]+\$|`[^`]*`", "x", answer)  # math and code are not sentences
        assert prose.endswith(".") and not re.search(r"[.?!]\s+[A-Z]", prose[:-1]), (
            f"{label}: not one sentence: {answer}")


def test_the_word_count_reads_math_links_and_markup_as_a_reader_does() -> None:
    shown = words(r"**Shapes?** {ref}`Each head outputs <ch3-shapes>` $n \times d_v$, then {ref}`ch3-fused`.")
    assert shown == ["Shapes?", "Each", "head", "outputs", "n", r"\times", "d_v", "then", "section."]


# The sections each answer links, as the cold readers asked: Q1 also proves Q = K = V = X, Q3
# the per-row map, Q2 "loses nothing" and tied matrices (W^Q = W^K) as well as "cheaper".
PROOFS = {"Q, K, V: one matrix or three?": {"ch2-input-itself", "ch3-fused"},
          "Shapes?": {"ch2-per-position", "ch3-shapes"},
          "Why two matrices?": {"ch4-cost", "ch4-nothing-lost", "ch2-qk-maps"},
          r"Why divide by $\sqrt{d_k}$?": {"ch1-scale"}}


def test_each_answer_links_the_sections_that_prove_it_and_they_exist() -> None:
    items, _ = in_short()
    linked = {label: set(re.findall(r"<([\w-]+)>`", answer)) for label, answer, _ in items}
    for label, needed in PROOFS.items():
        assert needed <= linked[label], f"{label}: links {linked[label]}, needs {needed}"
    anchors = set()
    for page in [*ROOT.glob("chapters/*.ipynb"), *ROOT.glob("*.md")]:
        anchors |= set(re.findall(r"\(([\w-]+)\)=", page.read_text()))
    missing = {a for links in linked.values() for a in links} - anchors
    assert not missing, f"links to no section: {missing}"
