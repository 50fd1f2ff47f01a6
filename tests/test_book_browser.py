"""The rendered book as a reader meets it: built, served on localhost, opened in Chromium.

Needs Debian's Chromium (``apt-get install chromium``) and the ``playwright`` Python
package (in requirements.txt; Playwright's own browser download is not used). Without
a browser these tests skip with a message saying how to install one, except under
``CI=true``, where a missing browser is a failure.
"""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def _chromium() -> str | None:
    env = os.environ.get("ATTNLIB_CHROMIUM")
    for path in ([env] if env else []) + list(CHROMIUM_CANDIDATES):
        if path and Path(path).is_file():
            return path
    return shutil.which("chromium")


def _require_browser() -> str:
    chromium = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        chromium = None
    if chromium is None:
        msg = (
            "browser tests need Chromium and the playwright package: "
            "`apt-get install chromium` and `pip install -r requirements.txt` "
            "(or set ATTNLIB_CHROMIUM to a Chromium binary)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return chromium


def _toc_pages() -> list[str]:
    """Page names (without suffix) in ``_toc.yml`` order, root first."""
    text = (ROOT / "_toc.yml").read_text()
    root = re.search(r"^root:\s*(\S+)", text, re.M)
    assert root, "_toc.yml has no root"
    return [root.group(1)] + re.findall(r"-\s*file:\s*(\S+)", text)


# What the HTML is built from: a build older than any of these is stale.
BOOK_SOURCES = ("_config.yml", "_toc.yml", "*.md", "references.bib", "chapters/*.ipynb", "attnlib/*/*.py",
                "attnlib/*.py", "_static/*", "_ext/*.py", "images/*")


def _stale_sources(html: Path) -> list[str]:
    """Sources newer than the build in ``html`` (its ``index.html``), by name."""
    built_at = (html / "index.html").stat().st_mtime
    return sorted(str(p.relative_to(ROOT)) for pattern in BOOK_SOURCES
                  for p in ROOT.glob(pattern) if p.stat().st_mtime > built_at)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the book's HTML.

    ``make test`` builds the book first (``make book``, warnings are errors) and names
    that build in ``ATTNLIB_BOOK_HTML``, so the tests read the very pages the build
    made instead of building them a second time. A build older than a source fails
    rather than testing old pages. Without the variable (a plain ``pytest``), the book
    is built here, into a temporary folder.
    """
    _require_browser()
    given = os.environ.get("ATTNLIB_BOOK_HTML")
    if given:
        html = Path(given)
        if not html.is_absolute():
            html = ROOT / html
        assert (html / "index.html").is_file(), (
            f"ATTNLIB_BOOK_HTML={given} holds no built book: run `make book` first")
        stale = _stale_sources(html)
        assert not stale, (f"the build in {given} is older than {', '.join(stale[:5])}: "
                           "run `make book` again")
        return html
    out = tmp_path_factory.mktemp("book")
    exe = Path(sys.executable).parent / "jupyter-book"
    jb = str(exe) if exe.is_file() else shutil.which("jupyter-book")
    assert jb, "jupyter-book is not installed: pip install -r requirements.txt"
    cmd = [jb, "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"book build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out / "_build" / "html"


def test_a_named_build_older_than_a_source_is_refused(tmp_path: Path) -> None:
    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text("<html></html>")
    os.utime(html / "index.html", (0, 0))  # built in 1970: every source is newer
    stale = _stale_sources(html)
    assert "_toc.yml" in stale and "chapters/01_one_query_many_keys.ipynb" in stale
    os.utime(html / "index.html", None)  # built now
    assert _stale_sources(html) == []


@pytest.fixture(scope="module")
def site(built: Path) -> Iterator[str]:
    """The built book, served on 127.0.0.1."""
    html = built
    handler = functools.partial(QuietHandler, directory=str(html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def browser(site: str) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_require_browser(), args=CHROMIUM_ARGS)
        yield b
        b.close()


class PageVisit:
    """A page opened in a fresh tab, with every console error, page error and
    request that left localhost (or, for a file:// page, the disk) recorded: the book
    must need no network.

    Opening starts the navigation and returns; :meth:`ready` waits until the page
    is parsed, MathJax has typeset it and every image has loaded or failed.
    :meth:`open` takes the same tab to another page, with a fresh record: one tab for many
    pages costs Chromium about half the CPU of a new tab per page (a new renderer, MathJax
    compiled again), measured over the book's pages (28 against 40-67 CPU-seconds).
    """

    def __init__(self, browser: object, url: str, width: int = 1280) -> None:
        # browser: a playwright Browser (a fresh context per page) or one BrowserContext
        # (pages share its cache, so MathJax is fetched and compiled once)
        self.page = browser.new_page()  # type: ignore[attr-defined]
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._record)
        self.open(url, width)

    def open(self, url: str, width: int = 1280) -> "PageVisit":
        """Start loading ``url`` in this tab, at ``width``; errors and requests are recorded
        afresh, for this page only."""
        self.from_disk = url.startswith("file://")  # then file:// requests are local too
        self.errors: list[str] = []
        self.external: list[str] = []
        self.page.set_viewport_size({"width": width, "height": 900})
        self.page.goto(url, wait_until="commit")
        return self

    def ready(self) -> "PageVisit":
        self.page.wait_for_load_state("domcontentloaded")
        # MathJax 3 resolves startup.promise once it has typeset the page.
        self.page.wait_for_function("() => !window.MathJax || (window.MathJax.startup && "
                                    "window.MathJax.startup.promise)", timeout=20000)
        self.page.evaluate("() => window.MathJax ? MathJax.startup.promise : null")
        # Images: wait until each has loaded or failed (naturalWidth tells which later).
        self.page.wait_for_function(
            "() => [...document.images].every(i => i.complete)", timeout=20000)
        return self

    def _record(self, request: object) -> None:
        url = request.url  # type: ignore[attr-defined]
        local = urlparse(url).hostname in ("127.0.0.1", "localhost") or url.startswith(("data:", "blob:"))
        if not (local or (self.from_disk and url.startswith("file://"))):
            self.external.append(url)

    def close(self) -> None:
        self.page.close()


PAGES = _toc_pages()

# What a page looks like to the reader, read once per page and width; the tests
# below assert on these records.
_READ_PAGE = """() => {
    const math = [...document.querySelectorAll('span.math, div.math')];
    const abs = a => a.href;
    return {
        title: document.title,
        mathTotal: math.length,
        untypeset: math.filter(n => !n.querySelector('mjx-container')).map(n => n.textContent.slice(0, 80)),
        mathErrors: document.querySelectorAll('mjx-merror').length,
        mathjaxSrc: [...document.scripts].map(s => s.src).filter(s => /mathjax/i.test(s)),
        text: (document.querySelector('article') || document.body).innerText,
        // Everything a reader sees as prose: the article without code, plus the
        // sidebar, the previous/next links and the window title.
        prose: (() => {
            const article = (document.querySelector('article') || document.body).cloneNode(true);
            article.querySelectorAll('pre, code, .highlight, .cell_output, mjx-container, script, style')
                .forEach(n => n.remove());
            const chrome = [...document.querySelectorAll('nav.bd-docs-nav, .prev-next-area')]
                .map(n => { const c = n.cloneNode(true); c.querySelectorAll('mjx-container, script').forEach(m => m.remove()); return c.textContent; });
            return [document.title, article.textContent, ...chrome].join(' ');
        })(),
        images: [...document.querySelectorAll('article img')].map(i => ({
            src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0, alt: i.getAttribute('alt')})),
        captions: [...document.querySelectorAll('article figure')].map(
            f => (f.querySelector('figcaption') || {textContent: ''}).textContent.trim()),
        nav: [...document.querySelectorAll('nav.bd-docs-nav a')].map(abs),
        next: [...document.querySelectorAll('a.right-next')].map(abs),
        prev: [...document.querySelectorAll('a.left-prev')].map(abs),
        downloads: [...document.querySelectorAll('.dropdown-download-buttons a')].map(abs),
        overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
    };
}"""


@pytest.fixture(scope="module")
def pages(browser: object, site: str) -> dict[str, dict[str, dict]]:
    """Every page read at desktop width (1280 px), then at phone width (390 px).

    One page at a time, in one tab of one browser context: the pages share its cache, and
    on two cores this is quicker than opening them all at once (measured: 25 s against 30 s
    of wall time), and one tab for all pages costs Chromium about half the CPU of a new tab
    per page (see PageVisit.open)."""
    records: dict[str, dict[str, dict]] = {"desktop": {}, "phone": {}}
    context = browser.new_context()  # type: ignore[attr-defined]
    visit: PageVisit | None = None
    try:
        for name in PAGES:
            url = urljoin(site, f"{name}.html")
            visit = visit.open(url) if visit else PageVisit(context, url)  # one tab, page after page
            visit.ready()
            records["desktop"][name] = visit.page.evaluate(_READ_PAGE)
            visit.page.set_viewport_size({"width": 390, "height": 800})
            # let the layout settle: two animation frames after the resize
            visit.page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            records["phone"][name] = visit.page.evaluate(_READ_PAGE)
            for record in records["desktop"][name], records["phone"][name]:
                record["errors"], record["external"] = visit.errors, visit.external
    finally:
        if visit:
            visit.close()
        context.close()
    return records


@pytest.fixture(scope="module")
def desktop(pages: dict[str, dict[str, dict]]) -> dict[str, dict]:
    return pages["desktop"]


@pytest.fixture(scope="module")
def phone(pages: dict[str, dict[str, dict]]) -> dict[str, dict]:
    return pages["phone"]


@pytest.mark.parametrize("name", PAGES)
def test_math_is_typeset_by_the_books_own_mathjax(desktop: dict, site: str, name: str) -> None:
    page = desktop[name]
    assert page["title"], f"{name}: empty <title>"
    assert not page["untypeset"], f"{name}: math left as raw TeX: {page['untypeset'][:3]}"
    assert page["mathErrors"] == 0, f"{name}: {page['mathErrors']} MathJax errors"
    if page["mathTotal"]:
        assert page["mathjaxSrc"], f"{name}: has math but loads no MathJax"
    assert all(s.startswith(site) for s in page["mathjaxSrc"]), (
        f"{name}: MathJax must be served by the book, got {page['mathjaxSrc']}"
    )
    raw_tex = re.findall(r"\\(?:top|frac|mathrm|sqrt|times|mathbb|left|right|sum|in)\b|\$\$?[^$\s]|\^\{|_\{", page["prose"])
    assert not raw_tex, f"{name}: raw TeX visible to the reader: {raw_tex[:5]}"


def test_the_chapters_have_math(desktop: dict) -> None:
    """Guards the test above against passing on pages that simply have no math."""
    for name in PAGES:
        if name.startswith("chapters/"):
            assert desktop[name]["mathTotal"] >= 5, f"{name}: only {desktop[name]['mathTotal']} formulas"


@pytest.mark.parametrize("name", PAGES)
def test_images_load_with_alt_text_and_captions(desktop: dict, name: str) -> None:
    page = desktop[name]
    broken = [i["src"] for i in page["images"] if not i["ok"]]
    assert not broken, f"{name}: images that did not load: {broken}"
    no_alt = [i["src"] for i in page["images"] if not (i["alt"] or "").strip()]
    assert not no_alt, f"{name}: images without alt text: {no_alt}"
    assert all(page["captions"]), f"{name}: a figure without a caption"


@pytest.mark.parametrize("name", PAGES)
def test_no_console_errors_no_external_requests_no_tracebacks(desktop: dict, name: str) -> None:
    page = desktop[name]
    assert not page["external"], f"{name}: requests left the book (CDN?): {page['external'][:5]}"
    assert not page["errors"], f"{name}: console errors: {page['errors'][:5]}"
    assert "Traceback (most recent call last)" not in page["text"], f"{name}: a traceback is shown"


def test_sidebar_lists_every_page_and_prev_next_follow_the_toc(desktop: dict) -> None:
    for name in PAGES[1:]:
        assert any(h.split("#")[0].endswith(f"/{name}.html") for h in desktop[PAGES[0]]["nav"]), (
            f"sidebar lacks {name}"
        )
    for before, after in zip(PAGES, PAGES[1:]):
        assert [h.split("#")[0] for h in desktop[before]["next"]][-1:] and \
            desktop[before]["next"][-1].split("#")[0].endswith(f"/{after}.html"), f"next of {before}"
        assert desktop[after]["prev"] and desktop[after]["prev"][-1].split("#")[0].endswith(f"/{before}.html"), (
            f"previous of {after}"
        )


def test_search_finds_a_word_from_chapter_1(browser: object, site: str) -> None:
    visit = PageVisit(browser, urljoin(site, "search.html?q=softmax")).ready()
    try:
        visit.page.wait_for_selector("ul.search li", timeout=15000)
        hits = visit.page.eval_on_selector_all("ul.search li a", "els => els.map(e => e.href)")
        assert any("01_one_query_many_keys" in h for h in hits), f"search for softmax found {hits}"
    finally:
        visit.close()


def test_search_sends_causal_mask_and_cross_attention_to_their_section(
        browser: object, site: str, built: Path) -> None:
    """A learner who types "causal mask" or "cross-attention" gets, as the first hit, chapter 2's
    section on self-, cross- and causal attention, not a page that merely uses the words. The
    section's main index entries do it: Sphinx's search scores an exact entry above any text
    match. One search runs in the browser; the other entry is read from the search index."""
    visit = PageVisit(browser, urljoin(site, "search.html?q=causal+mask")).ready()
    try:
        visit.page.wait_for_selector("ul.search li", timeout=15000)
        first = visit.page.eval_on_selector("ul.search li a", "e => e.href")
    finally:
        visit.close()
    page, _, anchor = first.partition("#")
    assert page.endswith("chapters/02_where_qkv_come_from.html") and anchor, f"first hit: {first}"
    index = json.loads(re.search(r"Search\.setIndex\((.*)\)", (built / "searchindex.js").read_text(), re.S)[1])
    chapter_2 = index["docnames"].index("chapters/02_where_qkv_come_from")
    for entry in ("causal mask", "cross-attention"):
        assert [chapter_2, anchor, True] in index["indexentries"].get(entry, []), (
            f"{entry!r} is not a main index entry at {anchor}: {index['indexentries'].get(entry)}")
    # the anchor sits just before the section's heading, so the section opens at its title
    html = (built / "chapters" / "02_where_qkv_come_from.html").read_text()
    heading = re.search(r"<h2>(.*?)<a", html[html.index(f'id="{anchor}"'):], re.S)
    assert heading and "Self-, cross- and causal attention" in heading[1], heading


@pytest.mark.parametrize("name", [p for p in PAGES if p.startswith("chapters/")])
def test_download_notebook_button(desktop: dict, browser: object, name: str) -> None:
    ipynb = [h for h in desktop[name]["downloads"] if h.endswith(".ipynb")]
    assert ipynb, f"{name}: no .ipynb download button (found {desktop[name]['downloads']})"
    with urllib.request.urlopen(ipynb[0]) as response:
        assert b'"cells"' in response.read(), f"{name}: {ipynb[0]} is not a notebook"


@pytest.mark.parametrize("name", PAGES)
def test_phone_width_has_no_horizontal_scroll(phone: dict, name: str) -> None:
    """At 390 px (a phone) the page itself does not scroll sideways (wide code and
    tables scroll inside their own boxes)."""
    assert phone[name]["overflow"] <= 1, f"{name}: page is {phone[name]['overflow']}px wider than 390px"
    assert not phone[name]["errors"], f"{name}: console errors at phone width: {phone[name]['errors'][:3]}"


def test_missing_browser_skips_with_install_hint_or_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Chromium the browser tests skip and say how to install it; under
    CI=true the same situation is a failure, so CI cannot pass without a browser."""
    monkeypatch.setattr(sys.modules[__name__], "_chromium", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        _require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install chromium"):
        _require_browser()


# ---- interactive figures (attnlib/explorers.py, _static/explorers.js) ----------------------
# Every element with data-explorer="<name>" on every page: it starts (the static PNG
# is replaced by a drawing), its controls are native and labelled, and operating each
# control, by keyboard and by mouse, changes the figure; its labels stay readable in
# light and dark mode; and it works from file:// with no server.

_EXPLORER_STATE = """root => ({
    ready: root.classList.contains('explorer-ready'),
    fallbacks: root.querySelectorAll('.explorer-fallback').length,
    figure: [...root.querySelectorAll('svg.explorer-figure')].map(s => s.outerHTML).join('\\n'),
    controls: [...root.querySelectorAll('select, input, button, textarea')].map(c => ({
        tag: c.tagName.toLowerCase(), type: c.type, id: c.id, tabIndex: c.tabIndex,
        label: (c.getAttribute('aria-label') || (c.id && root.querySelector(`label[for="${c.id}"]`)
                || {textContent: ''}).textContent || (c.closest('label') || {textContent: ''}).textContent).trim(),
        nOptions: c.options ? c.options.length : 0, value: c.value, min: c.min, max: c.max,
        pressed: c.getAttribute('aria-pressed')})),
})"""


def _explorer_pages(site: str) -> dict[str, list[str]]:
    """Page name -> ids of its explorers, read from the served HTML."""
    found: dict[str, list[str]] = {}
    for name in PAGES:
        with urllib.request.urlopen(urljoin(site, f"{name}.html")) as response:
            text = response.read().decode("utf-8")
        roots = re.findall(r'<[^>]*\bdata-explorer="[^"]+"[^>]*>', text)
        ids = [re.search(r'\bid="([^"]+)"', r) for r in roots]
        assert all(ids), f"{name}: an explorer root without an id: {roots}"
        if ids:
            found[name] = [m.group(1) for m in ids if m]
    return found


_FIGURE = "root => [...root.querySelectorAll('svg.explorer-figure')].map(s => s.outerHTML).join('\\n')"
_CONTROLS = "root => [...root.querySelectorAll('select, input, button, textarea')]"


def _operate_every_control(page: object, root_id: str) -> list[str]:
    """Operate each control of one explorer by keyboard and by mouse; return what failed."""
    root = page.locator(f"#{root_id}")  # type: ignore[attr-defined]
    failed: list[str] = []

    def check(what: str, action: object) -> None:
        before = root.evaluate(_FIGURE)
        action()  # type: ignore[operator]
        if root.evaluate(_FIGURE) == before:
            failed.append(f"{root_id}: {what} did not change the figure")

    def nth(i: int) -> object:
        # found again each time: a control may rebuild others (the sentence, the tokens)
        return root.locator("select, input, button, textarea").nth(i)

    def value(i: int) -> str:
        return root.evaluate(f"r => ({_CONTROLS})(r)[{i}].value")  # type: ignore[no-any-return]

    def pressed(i: int) -> bool:
        return root.evaluate(f"r => ({_CONTROLS})(r)[{i}].getAttribute('aria-pressed') === 'true'")  # type: ignore[no-any-return]

    controls = root.evaluate(_EXPLORER_STATE)["controls"]
    buttons = [i for i, c in enumerate(controls) if c["tag"] == "button"]
    for i, c in enumerate(controls):
        what = f"{c['tag']} {c['id'] or c['label']!r}"
        if c["tag"] == "select":
            key = "ArrowUp" if value(i) == str(c["nOptions"] - 1) else "ArrowDown"
            check(f"{what} by keyboard ({key})", lambda: (nth(i).focus(), page.keyboard.press(key)))  # type: ignore[attr-defined]
            other = "0" if value(i) != "0" else "1"
            # a native <select> opens a popup drawn outside the page; choosing from it is
            # what select_option does (the same input and change events as a click)
            check(f"{what} by mouse", lambda: nth(i).select_option(other))  # type: ignore[attr-defined]
        elif c["tag"] == "input" and c["type"] == "range":
            key = "Home" if value(i) == c["max"] else "End"
            check(f"{what} by keyboard ({key})", lambda: (nth(i).focus(), page.keyboard.press(key)))  # type: ignore[attr-defined]
            box = nth(i).bounding_box()  # type: ignore[attr-defined]
            x = box["x"] + box["width"] * (0.5 if key == "Home" else 0.1)  # away from where it is
            check(f"{what} by mouse", lambda: page.mouse.click(x, box["y"] + box["height"] / 2))  # type: ignore[attr-defined]
        elif c["tag"] == "button":
            another = next(j for j in buttons if j != i)
            if len(buttons) > 1 and pressed(i):
                nth(another).click()  # type: ignore[attr-defined]
            check(f"{what} by mouse", lambda: nth(i).click())  # type: ignore[attr-defined]
            nth(another).click()  # type: ignore[attr-defined]

            # from the control before it, Tab moves the focus onto it, Enter presses it
            def tab_to() -> None:
                nth(i - 1).focus()  # type: ignore[attr-defined]
                page.keyboard.press("Tab")  # type: ignore[attr-defined]
                page.keyboard.press("Enter")  # type: ignore[attr-defined]

            check(f"{what} by keyboard (Tab, Enter)", tab_to)
            if not pressed(i):
                failed.append(f"{root_id}: {what}: Tab and Enter did not select it")
        else:
            failed.append(f"{root_id}: unexpected control {what}")
    return failed


def _contrast(a: list[float], b: list[float]) -> float:
    def lum(c: list[float]) -> float:
        ch = [v / 255 for v in c[:3]]
        lin = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in ch]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


_COLOURS = """root => {
    const rgb = s => (s.match(/[\\d.]+/g) || []).map(Number);
    let bg = root, colour = getComputedStyle(root).backgroundColor;
    while (bg && (rgb(colour).length === 4 && rgb(colour)[3] === 0 || colour === 'transparent')) {
        bg = bg.parentElement; colour = bg ? getComputedStyle(bg).backgroundColor : 'rgb(255, 255, 255)';
    }
    const text = root.querySelector('svg text.explorer-label');
    return {background: rgb(colour), text: rgb(getComputedStyle(text).fill),
            label: rgb(getComputedStyle(root.querySelector('label')).color)};
}"""


@pytest.fixture(scope="module")
def explorer_pages(site: str) -> dict[str, list[str]]:
    return _explorer_pages(site)


@pytest.fixture(scope="module")
def explorer_checks(browser: object, built: Path, explorer_pages: dict[str, list[str]]) -> dict[str, dict]:
    """Each page with explorers, opened once straight from the disk (file://, no server), as a
    reader who double-clicks the built HTML does. On that one visit, every control of every
    explorer is operated (``_controls_failures``), then every view is driven and the numbers
    drawn are read (``_numbers_failures``); the two tests below assert on what was found.
    One page at a time, in one tab."""
    context = browser.new_context()  # type: ignore[attr-defined]
    checks: dict[str, dict] = {}
    visit: PageVisit | None = None
    try:
        for name, ids in explorer_pages.items():
            url = (built / f"{name}.html").as_uri()
            visit = (visit.open(url) if visit else PageVisit(context, url)).ready()  # one tab
            for root_id in ids:
                visit.page.locator(f"#{root_id}").scroll_into_view_if_needed()
                visit.page.wait_for_function(
                    "id => document.getElementById(id).classList.contains('explorer-ready')",
                    arg=root_id, timeout=10000)
            controls = _controls_failures(visit, name, ids)
            controls_errors = list(visit.errors)
            numbers, kinds = _numbers_failures(visit, name, ids)
            checks[name] = {"controls": controls, "controls_errors": controls_errors,
                            "numbers": numbers, "kinds": kinds, "errors": list(visit.errors),
                            "external": list(visit.external)}
    finally:
        if visit:
            visit.close()
        context.close()
    return checks


def test_the_book_has_its_explorers(explorer_pages: dict[str, list[str]]) -> None:
    """Guards the tests below against passing on a book without interactive figures."""
    names = [i for ids in explorer_pages.values() for i in ids]
    assert {"explorer-sharpness", "explorer-heads", "explorer-online-softmax",
            "explorer-composition"} <= set(names), explorer_pages
    assert len(names) == len(set(names))


def _controls_failures(visit: PageVisit, name: str, ids: list[str]) -> list[str]:  # noqa: C901
    """Every explorer on one open page: it has started (no static fallback left), its controls
    are native, labelled and reachable by Tab, operating each by keyboard and by mouse changes
    the figure, and its labels keep a contrast of 4.5:1 in light and dark mode. Returns what
    failed."""
    failed: list[str] = []
    width = 1280
    for root_id in ids:
        root = visit.page.locator(f"#{root_id}")
        root.scroll_into_view_if_needed()
        st = root.evaluate(_EXPLORER_STATE)
        if st["fallbacks"]:
            failed.append(f"{name}: {root_id} still shows its static fallback")
        if not st["figure"]:
            failed.append(f"{name}: {root_id} draws no svg.explorer-figure")
        kinds = {c["tag"] for c in st["controls"]}
        if not kinds & {"select", "input"}:
            failed.append(f"{name}: {root_id} has no select or slider")
        for c in st["controls"]:
            if c["tag"] not in ("select", "input", "button") or (c["tag"] == "input" and c["type"] != "range"):
                failed.append(f"{name}: {root_id}: not a native select, slider or button: {c}")
            if not c["label"]:
                failed.append(f"{name}: {root_id}: a control without a label: {c}")
            if c["tabIndex"] < 0:
                failed.append(f"{name}: {root_id}: not reachable by Tab: {c}")
        failed += [f"{name} @{width}px: {f}" for f in _operate_every_control(visit.page, root_id)]
        # light and dark: labels keep a contrast of at least 4.5:1 (WCAG AA)
        for theme in ("light", "dark"):
            visit.page.evaluate(f"document.documentElement.dataset.theme = '{theme}'")
            c = root.evaluate(_COLOURS)
            for what in ("text", "label"):
                ratio = _contrast(c[what], c["background"])
                if ratio < 4.5:
                    failed.append(f"{name} ({theme}): {root_id} {what} contrast {ratio:.1f}: {c}")
    return failed


def test_every_explorer_starts_with_labelled_native_controls_that_change_the_figure(
        explorer_checks: dict[str, dict]) -> None:
    """Each page is opened straight from the disk (file://, no server), as a reader who
    double-clicks the built HTML does; every explorer starts and answers every control, with
    no console error and no request off the disk. (Served over http, the same pages are read,
    with their console errors and requests, by the ``pages`` fixture above; the phone width by
    test_phone_width_has_no_horizontal_scroll.)"""
    failed = [f for check in explorer_checks.values() for f in check["controls"]]
    for name, check in explorer_checks.items():
        assert not check["controls_errors"], f"{name}: console errors: {check['controls_errors'][:5]}"
        assert not check["external"], f"{name}: requests off the disk: {check['external'][:5]}"
    assert not failed, "\n".join(failed)


# ---- the numbers the explorers draw, against attnlib ---------------------------------------
# Each explorer is driven through all of its views in the page (its own controls, their own
# events), and what its script drew -- the bars' lengths and labels, the cells' opacities,
# the read-out -- is compared with attnlib's computation from the data embedded in the page.

_SHARPNESS_VIEWS = """root => {
    const data = JSON.parse(root.querySelector('script.explorer-data').textContent);
    const query = root.querySelector(`#${root.id}-query`), beta = root.querySelector(`#${root.id}-beta`);
    const views = [];
    for (let q = 0; q < data.queries.length; q++) {
        query.value = String(q); query.dispatchEvent(new Event('change'));
        for (let b = 0; b < data.betas.length; b++) {
            beta.value = String(b); beta.dispatchEvent(new Event('input'));
            const fig = root.querySelector('svg.explorer-figure');
            views.push({q, b,
                tracks: [...fig.querySelectorAll('rect.explorer-track')].map(r => +r.getAttribute('width')),
                bars: [...fig.querySelectorAll('rect.explorer-bar')].map(r => +r.getAttribute('width')),
                best: [...fig.querySelectorAll('rect.explorer-bar')].map(r => r.classList.contains('explorer-best')),
                labels: [...fig.querySelectorAll('text.explorer-label')].map(t => t.textContent),
                readout: root.querySelector('.explorer-readout').textContent});
        }
    }
    return {data, views};
}"""

_HEADS_VIEWS = """([root, wanted]) => {
    const data = JSON.parse(root.querySelector('script.explorer-data').textContent);
    const choose = (name, value, event) => {
        const c = root.querySelector(`#${root.id}-${name}`);
        if (c.value !== String(value)) { c.value = String(value); c.dispatchEvent(new Event(event)); }
    };
    return wanted.map(([s, l, h, r]) => {
        choose('sentence', s, 'change'); choose('layer', l, 'change');
        choose('head', h, 'change'); choose('rank', r, 'input');
        const links = root.querySelector('svg.explorer-lines');
        return {s, l, h, r,
            cells: [...root.querySelectorAll('svg.explorer-heat rect.explorer-cell')]
                .map(c => c.getAttribute('fill-opacity')),
            query: [...root.querySelectorAll('button.explorer-token')]
                .findIndex(b => b.getAttribute('aria-pressed') === 'true'),
            links: [...links.querySelectorAll('line.explorer-link')].map(x => x.getAttribute('stroke-width')),
            labels: [...links.querySelectorAll('text.explorer-label')].map(t => t.textContent)};
    });
}"""

_ONLINE_SOFTMAX_VIEWS = """root => {
    const data = JSON.parse(root.querySelector('script.explorer-data').textContent);
    const block = root.querySelector(`#${root.id}-block`), step = root.querySelector(`#${root.id}-step`);
    const num = (node, a) => +node.getAttribute(a);
    const views = [];
    for (let b = 0; b < data.blocks.length; b++) {
        block.value = String(b); block.dispatchEvent(new Event('change'));
        for (let t = 0; t <= +step.max; t++) {
            step.value = String(t); step.dispatchEvent(new Event('input'));
            const fig = root.querySelector('svg.explorer-figure');
            const axis = [...fig.querySelectorAll('text.explorer-axis[text-anchor="end"]')];
            const max = fig.querySelector('line.explorer-max');
            views.push({b, t, max_t: +step.max,
                output: root.querySelector(`#${root.id}-step-value`).textContent,
                zero: num(fig.querySelector('line.explorer-zero'), 'y1'),
                axis: axis.map(a => [num(a, 'y'), a.textContent]),
                bars: [...fig.querySelectorAll('rect')].map(r => ({y: num(r, 'y'), height: num(r, 'height'),
                    cls: r.getAttribute('class')})),
                seps: [...fig.querySelectorAll('line.explorer-sep')].map(l => num(l, 'x1')),
                xs: [...fig.querySelectorAll('rect')].map(r => num(r, 'x')),
                max: max ? [num(max, 'y1'), num(max, 'y2')] : null,
                labels: [...fig.querySelectorAll('text.explorer-label')].map(t => t.textContent),
                readout: root.querySelector('.explorer-readout').textContent});
        }
    }
    return {data, views};
}"""


def _heads_views(data: dict) -> list[list[int]]:
    """The views of the heads explorer to check: every head of every layer and sentence at
    rank 1 and at full rank (the indexing of the factors), and every rank of the default head
    of each sentence (the truncation)."""
    R, (l0, h0) = data["rank"], data["default"]
    views = [[s, l, h, r] for s in range(len(data["tokens"])) for l in range(data["layers"])
             for h in range(data["heads"]) for r in (1, R)]
    views += [[s, l0, h0, r] for s in range(len(data["tokens"])) for r in range(2, R)]
    return views


def _check_sharpness(root_id: str, got: dict) -> list[str]:
    """Chapter 1: softmax(beta K q) per query and beta (attnlib.attention in sharpness_explorer,
    stored to 3 decimals) and the read alpha V, against the bars, labels and read-out drawn."""
    import numpy as np
    import torch

    from attnlib import attention
    from attnlib.explorers import from_rounded

    data, failed = got["data"], []
    n_q, n_b, n_k, d_v = len(data["queries"]), len(data["betas"]), len(data["keys"]), data["dv"]
    weights = np.asarray(data["weights"], np.float64).reshape(n_q, n_b, n_k)  # (n_q, n_b, n_k)
    reads = from_rounded(data["reads"]).reshape(n_q, n_b, d_v)
    values = from_rounded(data["values"]).reshape(n_k, d_v)
    # the reads are what attention computes with these weights: alpha V (up to the rounding stored)
    w_t = torch.from_numpy(weights)
    mixed = torch.einsum("qbk,kv->qbv", w_t, torch.from_numpy(values)).numpy()
    slack = 0.0005 * np.abs(values).sum(0) + 10.0 ** data["reads"]["e"] + 10.0 ** data["values"]["e"] * n_k
    if not np.all(np.abs(mixed - reads) <= slack):
        failed.append(f"{root_id}: the embedded reads are not the weights times the values")
    # and the weights are a distribution, as attnlib's softmax gives (rows sum to 1 up to rounding)
    _, one = attention(torch.zeros(1, 1, dtype=torch.float64), torch.zeros(n_k, 1, dtype=torch.float64),
                       torch.zeros(n_k, 1, dtype=torch.float64))  # uniform: 1/n_k each
    if not np.allclose(weights.sum(-1), float(one.sum()), atol=0.0005 * n_k):
        failed.append(f"{root_id}: embedded weights do not sum to 1")
    assert len(got["views"]) == n_q * n_b
    for v in got["views"]:
        q, b, w = v["q"], v["b"], weights[v["q"], v["b"]]
        where = f"{root_id} query {data['queries'][q]}, beta {data['betas'][b]}"
        drawn = np.asarray(v["bars"]) / np.asarray(v["tracks"])  # bar length / full length
        if len(drawn) != n_k or not np.all(np.abs(drawn - w) <= 0.005 / np.asarray(v["tracks"]) + 1e-12):
            failed.append(f"{where}: bars {drawn.round(4).tolist()} != weights {w.tolist()}")
        labels = v["labels"][1::2]  # key name, its weight, key name, ...
        if v["labels"][0::2] != data["keys"] or labels != [f"{x:.3f}" for x in w]:
            failed.append(f"{where}: labels {v['labels']} != keys and weights {w.tolist()}")
        best = int(np.argmax(w))
        if v["best"] != [j == best for j in range(n_k)]:
            failed.append(f"{where}: the highlighted bar is not key {data['keys'][best]}")
        m = re.search(r"reads \[([^\]]*)\]; the most weight, ([\d.]+), is on (.+), whose value is \[([^\]]*)\]\.$",
                      v["readout"])
        if not m:
            failed.append(f"{where}: unexpected read-out {v['readout']!r}")
            continue
        shown = np.asarray([float(x) for x in m.group(1).split(", ")])
        if not np.all(np.abs(shown - reads[q, b]) <= 0.005 + 1e-9) or float(m.group(2)) != round(w[best], 3) \
                or m.group(3) != data["keys"][best] \
                or [float(x) for x in m.group(4).split(", ")] != [round(x) for x in values[best]]:
            failed.append(f"{where}: read-out {v['readout']!r}, expected reads {reads[q, b].tolist()}")
    return failed


def _check_heads(root_id: str, got: dict) -> list[str]:
    """Chapter 6: softmax(P_r K_r^T + 1 c^T) from the embedded factors, computed by
    attnlib.attention (queries [P_r | 1] with the columns from r on zeroed, keys [K | c],
    scale 1), against every cell of the drawn map and the line weights of the reading token."""
    import numpy as np
    import torch

    from attnlib import attention
    from attnlib.explorers import from_rounded

    data, failed = got["data"], []
    R = data["rank"]

    @functools.cache
    def maps(s: int) -> np.ndarray:
        """Every head's map at every rank r = 1..R for sentence s: (layers, heads, R, t, t)."""
        t, per_layer = len(data["tokens"][s]), data["sentences"][s]
        factors = {f: torch.from_numpy(np.stack([[from_rounded(e[f]) for e in heads] for heads in per_layer]))
                   for f in "pkc"}  # (L, H, t*R) for p and k, (L, H, t) for c
        p = factors["p"].unflatten(-1, (t, R))  # (L, H, t, R)
        k = factors["k"].unflatten(-1, (t, R))  # (L, H, t, R)
        keep = (torch.arange(R)[None, :] < torch.arange(1, R + 1)[:, None]).double()  # (R, R): rank r keeps a < r
        ones = torch.ones(*p.shape[:2], R, t, 1, dtype=torch.float64)
        q = torch.cat([p[:, :, None] * keep[:, None, :], ones], -1)  # (L, H, R, t, R+1)
        keys = torch.cat([k, factors["c"][..., None]], -1)[:, :, None]  # (L, H, 1, t, R+1)
        _, w = attention(q, keys, torch.eye(t, dtype=torch.float64), scale=1.0)  # (L, H, R, t, t)
        return w.numpy()

    for v in got["views"]:
        s, l, h, r = v["s"], v["l"], v["h"], v["r"]
        toks = data["tokens"][s]
        t = len(toks)
        where = f"{root_id} sentence {s}, layer {l}, head {h}, rank {r}"
        a = maps(s)[l, h, r - 1]  # (t, t)
        cells = np.asarray([float(x) for x in v["cells"]]).reshape(t, t)
        if cells.shape != (t, t) or not np.all(np.abs(cells - a) <= 0.0005 + 1e-9):
            failed.append(f"{where}: drawn map differs from attnlib's by {np.abs(cells - a).max():.4f}")
        q = v["query"]
        labels = [f"{tok} {x:.2f}" for tok, x in zip(toks, a[q])]
        # per token: its name in the "reads" column, then "<token> <weight to 2 decimals>" in
        # the "from" column (the JS and Python roundings may differ at a tie)
        if v["labels"][0::2] != toks or len(v["labels"]) != 2 * t:
            failed.append(f"{where}: line labels {v['labels']} do not name the tokens {toks}")
        for shown, want, x in zip(v["labels"][1::2], labels, a[q]):
            tok, num = shown.rsplit(" ", 1)
            if tok != want.rsplit(" ", 1)[0] or abs(float(num) - x) > 0.005 + 1e-9:
                failed.append(f"{where}: line label {shown!r}, expected {want!r}")
        widths = np.asarray([float(x) for x in v["links"]])
        if not np.all(np.abs(widths - (0.5 + 7 * a[q])) <= 0.005 + 1e-9):
            failed.append(f"{where}: line widths {widths.tolist()} do not follow the weights {a[q].tolist()}")
    return failed


def _online_softmax_states(data: dict) -> dict[int, list[tuple[float, float, np.ndarray]]]:
    """Chapter 10: per block size, the online softmax's state (m_t, l_t, o_t) after each
    step t = 1 .. ceil(n_k / b), from the embedded scores, by attnlib.blockwise.

    The scores s_j are the query's row, so q = [1], K = s (a column) and scale 1 give
    blockwise_attention exactly these scores. The page embeds no values v_j (only the
    states); they are the values implied by the one-key-at-a-time steps,
    v_j = (o_{j+1} - e^{L_j - L_{j+1}} o_j) e^{L_{j+1} - s_j} with L_c = logsumexp(s_{<c})
    (the merge of attnlib.blockwise, solved for the new key's value). Every other block
    size's states are then attnlib's blockwise_attention over the first min(t b, n_k) keys
    with block_k = b: the blocking must not change them."""
    import numpy as np  # noqa: F401  (the annotation)
    import torch

    from attnlib.blockwise import blockwise_attention

    s = torch.tensor(data["scores"], dtype=torch.float64)  # (n_k,)
    n_k, d_v = s.shape[0], data["dv"]
    ones = torch.ones(1, 1, dtype=torch.float64)  # (n_q = 1, d_k = 1)
    one_by_one = torch.tensor(data["steps"][data["blocks"].index(1)]["out"], dtype=torch.float64)  # (n_k+1, d_v)
    lse = torch.stack([torch.logsumexp(s[:c], 0) for c in range(1, n_k + 1)])  # (n_k,): L_1 .. L_n
    prev = torch.cat([torch.tensor([-torch.inf], dtype=torch.float64), lse[:-1]])  # L_0 .. L_{n-1}
    v = (one_by_one[1:] - torch.exp(prev - lse)[:, None] * one_by_one[:-1]) * torch.exp(lse - s)[:, None]
    assert v.shape == (n_k, d_v)
    states: dict[int, list[tuple[float, float, np.ndarray]]] = {}
    for b in data["blocks"]:
        states[b] = []
        for t in range(1, -(-n_k // b) + 1):
            c = min(t * b, n_k)
            r = blockwise_attention(ones, s[:c, None], v[:c], scale=1.0, block_k=b)
            m = float(s[:c].max())
            states[b].append((m, math.exp(float(r.lse[0]) - m), r.out[0].numpy()))
    return states


def _check_online_softmax(root_id: str, got: dict) -> list[str]:  # noqa: C901
    """Chapter 10: for every block size and every number of blocks visited, the bars (the
    scores; visited, current block, not yet visited), the block separators, the dashed
    running-max line and its label, the slider's read-out, and the printed running max,
    rescale factor, running sum and partial output, against attnlib's online softmax
    (_online_softmax_states) from the embedded scores."""
    import numpy as np

    data, failed = got["data"], []
    scores = np.asarray(data["scores"], np.float64)
    n_k, blocks = len(scores), data["blocks"]
    states = _online_softmax_states(data)
    last = states[blocks[0]][-1][2]  # the attention output, all keys
    hi, lo = max(0.0, scores.max()), min(0.0, scores.min())
    assert len(got["views"]) == sum(-(-n_k // b) + 1 for b in blocks), len(got["views"])

    # printed to 3 decimals from the embedded 4; the embedded numbers are of the unrounded
    # scores, ours of the scores to 4 decimals: l moves by up to l (e^0.0001 - 1)
    def close(shown: str, want: float, slack: float = 0.0) -> bool:
        return abs(float(shown) - want) <= 0.0005 + 0.0001 + slack + 1e-9

    def vec(text: str) -> np.ndarray:
        return np.asarray([float(x) for x in text.split(", ")])

    for v in got["views"]:
        b, t = blocks[v["b"]], v["t"]
        n_b, seen, first = -(-n_k // b), min(t * b, n_k), max(0, (t - 1) * b)
        where = f"{root_id} block size {b}, {t} block(s) visited"
        if v["max_t"] != n_b or v["output"] != f"{t} of {n_b}":
            failed.append(f"{where}: slider to {v['max_t']} reading {v['output']!r}, expected {n_b} blocks")
        # the vertical scale, from the axis: y(hi) and y(lo) labelled, the zero line at y(0)
        (y_hi, hi_text), (y_lo, lo_text) = v["axis"]
        if hi_text != f"{hi:.1f}" or lo_text != f"{lo:.1f}":
            failed.append(f"{where}: axis labelled {hi_text}, {lo_text}, expected {hi:.1f}, {lo:.1f}")
        px = (y_lo - y_hi) / (hi - lo)  # pixels per unit of score
        tol = 0.015 + 0.01 * (y_lo - y_hi) / (y_lo - y_hi - 0.01)  # each coordinate printed to 0.01 px
        if abs(v["zero"] - (y_hi + hi * px)) > tol:
            failed.append(f"{where}: the zero line at y = {v['zero']}, expected {y_hi + hi * px:.2f}")
        y0 = v["zero"]
        bars = v["bars"]
        want_cls = ["explorer-track" if j >= seen else "explorer-bar explorer-best" if j >= first else "explorer-bar"
                    for j in range(n_k)]
        if [r["cls"] for r in bars] != want_cls:
            failed.append(f"{where}: bar classes {[r['cls'] for r in bars]}, expected {want_cls}")
        top = np.asarray([r["y"] for r in bars])
        height = np.asarray([r["height"] for r in bars])
        if len(bars) != n_k or not np.all(np.abs(top - (y0 - np.maximum(scores, 0) * px)) <= 2 * tol) \
                or not np.all(np.abs(height - np.maximum(np.abs(scores) * px, 0.5)) <= 2 * tol):
            drawn = np.where(top < y0 - tol, (y0 - top) / px, -height / px)
            failed.append(f"{where}: bars drawn {drawn.round(3).tolist()}, scores {scores.tolist()}")
        # a separator between blocks: at the left edge of key k (bars sit 1.5 in their slots)
        xs, seps = np.asarray(v["xs"]), np.asarray(v["seps"])
        slot = (xs[-1] - xs[0]) / (n_k - 1)
        want_seps = xs[0] - 1.5 + np.arange(b, n_k, b) * slot
        if seps.shape != want_seps.shape or not np.all(np.abs(seps - want_seps) <= 0.03):
            failed.append(f"{where}: block separators at {seps.tolist()}, expected after every {b} keys")
        keys_named = [x for x in v["labels"] if not x.startswith("dashed")]
        if keys_named != [str(j) for j in range(n_k) if n_k <= 16 or j % 4 == 0]:
            failed.append(f"{where}: key labels {keys_named}")
        if t == 0:
            want = f"No key visited yet: m = −∞, running sum ℓ = 0, partial output 0. With all {n_k} keys the output is "
            if v["max"] is not None or not v["readout"].startswith(want) \
                    or not np.all(np.abs(vec(v["readout"][len(want) + 1:-2]) - last) <= 0.0006 + 1e-9):
                failed.append(f"{where}: {v['readout']!r} (max line {v['max']}), expected the output {last.round(3)}")
            continue
        m, ell, out = states[b][t - 1]
        # the dashed running max: where it is drawn, and what it says
        if v["max"] is None or abs(v["max"][0] - (y0 - m * px)) > 2 * tol or v["max"][0] != v["max"][1]:
            failed.append(f"{where}: running-max line at {v['max']}, expected y = {y0 - m * px:.2f} (m = {m})")
        lab = [x for x in v["labels"] if x.startswith("dashed: running max m = ")]
        if len(lab) != 1 or not close(lab[0].rsplit(" ", 1)[1], m):
            failed.append(f"{where}: running-max label {lab}, expected m = {m:.4f}")
        keys = f"key {first}" if seen - 1 == first else f"keys {first}–{seen - 1}"
        r = re.fullmatch(
            rf"After block {t} of {n_b} \({re.escape(keys)}\): running max m = (\S+?)"
            r"(?:, up from (\S+), so the earlier sum and output were rescaled by e\^\((\S+) − (\S+)\) = (\S+)"
            r"| \(unchanged: no rescale\))?"
            r"; running sum ℓ = (\S+); partial output \[([^\]]*)\]"
            r"(, the attention output\.|; with all (\d+) keys: \[([^\]]*)\]\.)", v["readout"])
        if not r:
            failed.append(f"{where}: unexpected read-out {v['readout']!r}")
            continue
        m_shown, up, up2, m2, factor, ell_shown, out_shown, tail, n_all, last_shown = r.groups()
        bad = []
        if not close(m_shown, m):
            bad.append(f"m = {m:.4f}")
        if t > 1:
            m_prev = states[b][t - 2][0]
            if (up is not None) != (m > m_prev):
                bad.append("a rescale" if m > m_prev else "no rescale")
            if up is not None and not (close(up, m_prev) and up2 == up and m2 == m_shown
                                       and close(factor, math.exp(m_prev - m))):
                bad.append(f"rescale by e^({m_prev:.4f} − {m:.4f}) = {math.exp(m_prev - m):.4f}")
        elif up is not None or "unchanged" in v["readout"]:
            bad.append("nothing about a rescale at the first block")
        if not close(ell_shown, ell, ell * 1.0001e-4):
            bad.append(f"ℓ = {ell:.4f}")
        if not np.all(np.abs(vec(out_shown) - out) <= 0.0006 + 1e-9) or len(vec(out_shown)) != data["dv"]:
            bad.append(f"partial output {out.round(4).tolist()}")
        if (t == n_b) != (n_all is None) or (n_all is not None and (
                int(n_all) != n_k or not np.all(np.abs(vec(last_shown) - last) <= 0.0006 + 1e-9))):
            bad.append(f"the output {last.round(4).tolist()} " + ("as the last block's" if t == n_b else "after it"))
        if bad:
            failed.append(f"{where}: read-out {v['readout']!r}, expected " + "; ".join(bad))
    return failed


_COMPOSITION_VIEWS = """root => {
    const data = JSON.parse(root.querySelector('script.explorer-data').textContent);
    const seed = root.querySelector(`#${root.id}-seed`), kind = root.querySelector(`#${root.id}-kind`);
    const views = [];
    for (let r = 0; r < data.seeds.length; r++) {
        seed.value = String(r); seed.dispatchEvent(new Event('change'));
        for (let k = 0; k < data.kinds.length; k++) {
            kind.value = String(k); kind.dispatchEvent(new Event('change'));
            const fig = root.querySelector('svg.explorer-figure');
            views.push({r, k, cells: [...fig.querySelectorAll('rect.explorer-cell')].map(c => +c.getAttribute('fill-opacity')),
                        labels: [...fig.querySelectorAll('text.explorer-label')].map(t => t.textContent),
                        readout: root.querySelector('.explorer-readout').textContent});
        }
    }
    return {data, views};
}"""


def _check_composition(root_id: str, got: dict) -> list[str]:
    """Chapter 11: every seed and kind, the drawn scores (cell labels and shading) and the
    read-out's largest pair, against attnlib.induction.composition_scores of the shipped runs."""
    from attnlib.induction import KINDS, composition_scores, load_runs

    data, failed = got["data"], []
    runs = load_runs()
    top = max(x for run in data["scores"] for m in run for row in m for x in row)
    assert len(got["views"]) == len(data["seeds"]) * len(KINDS)
    for v in got["views"]:
        r, k = v["r"], v["k"]
        want = composition_scores(runs.layer(r, 0), runs.layer(r, 1), KINDS[k])  # (h, h)
        h = want.shape[0]
        where = f"{root_id} seed {data['seeds'][r]}, {KINDS[k]}"
        shown = [float(x) for x in v["labels"] if re.fullmatch(r"\d\.\d{3}", x)]
        flat = want.flatten().tolist()
        if len(shown) != h * h or any(abs(a - b) > 0.0005 + 1e-9 for a, b in zip(shown, flat)):
            failed.append(f"{where}: cells labelled {shown}, attnlib {flat}")
        if any(abs(c - 0.6 * b / top) > 0.002 for c, b in zip(v["cells"], flat)):
            failed.append(f"{where}: shading {v['cells']} does not follow the scores")
        page = data["scores"][r][k]  # the read-out names the first largest of the 3-decimal scores
        flat_page = [x for row in page for x in row]
        i, j = divmod(flat_page.index(max(flat_page)), h)
        if f"layer-0 head {i} into layer-1 head {j}" not in v["readout"]:
            failed.append(f"{where}: read-out {v['readout']!r}, expected the pair ({i}, {j})")
    return failed


def _numbers_failures(visit: PageVisit, name: str, ids: list[str]) -> tuple[list[str], set[str]]:
    """Every view of every explorer on one open page, chosen through its own controls: what
    the script drew, against attnlib's computation. Returns what failed and the kinds checked."""
    failed: list[str] = []
    checked: set[str] = set()
    for root_id in ids:
        root = visit.page.locator(f"#{root_id}")
        kind = root.get_attribute("data-explorer")
        if kind == "sharpness":
            failed += _check_sharpness(root_id, root.evaluate(_SHARPNESS_VIEWS))
        elif kind == "heads":
            data = json.loads(root.evaluate("r => r.querySelector('script.explorer-data').textContent"))
            wanted = _heads_views(data)
            views = visit.page.evaluate(_HEADS_VIEWS, [root.element_handle(), wanted])
            if [[v[x] for x in "slhr"] for v in views] != wanted:
                failed.append(f"{name}: {root_id}: the views shown are not the views asked for")
            failed += _check_heads(root_id, {"data": data, "views": views})
        elif kind == "online-softmax":
            failed += _check_online_softmax(root_id, root.evaluate(_ONLINE_SOFTMAX_VIEWS))
        elif kind == "composition":
            failed += _check_composition(root_id, root.evaluate(_COMPOSITION_VIEWS))
        else:
            failed.append(f"{name}: {root_id}: no numeric check for explorer kind {kind!r}")
        checked.add(str(kind))
    return failed, checked


def test_the_explorers_draw_attnlibs_numbers(explorer_checks: dict[str, dict]) -> None:
    """Every view of every explorer: the numbers its script draws are attnlib's. (Read on the
    visit of the test above, after its controls were operated: every view is chosen here
    through the controls again.)"""
    failed = [f for check in explorer_checks.values() for f in check["numbers"]]
    checked = set().union(*(check["kinds"] for check in explorer_checks.values()))
    for name, check in explorer_checks.items():
        assert not check["errors"], f"{name}: console errors: {check['errors'][:5]}"
    assert checked >= {"sharpness", "heads", "online-softmax", "composition"}, checked
    assert not failed, "\n".join(failed[:20]) + (f"\n... and {len(failed) - 20} more" if len(failed) > 20 else "")
