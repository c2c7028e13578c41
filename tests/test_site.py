"""The course website: `mkdocs build --strict` (no warnings), its generated pages checked
against the repository, then served on localhost and driven in headless Chromium.

The chapters are executed notebooks (docs/notebooks.py): when tests/test_course.py ran
first in the same session they are reused, otherwise this module executes them (about a
minute each). Chromium and chromedriver come from Debian (`apt-get install chromium
chromium-driver`); without them the browser tests skip, and without a CJK font the
Chinese page's glyph check skips, unless MINIVLLM_REQUIRE_BROWSER=1 (CI), where they
fail. The browser resolves no host name but the local server's, as where the network is
closed (a classroom behind a proxy, `docker run --network none`): the pages
must load everything, MathJax included, from the site. Screenshots go to reports/site/.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "reports" / "site"
WAIT_S = 60
WINDOW = (1280, 900)  # the browser's window: a laptop's screen

pytestmark = [pytest.mark.site, pytest.mark.embedded]


# ------------------------------------------------------------------ the build

@pytest.fixture(scope="module")
def site(embedded_model_dir, tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    warnings = re.findall(r"^(?:WARNING|ERROR).*$", log, re.M)
    assert not warnings, "\n".join(warnings)
    return out


class _Text(HTMLParser):
    """Text of an HTML page, with the rows of its tables (cells as text, links kept)."""

    def __init__(self):
        super().__init__()
        self.parts, self.rows, self._row, self._cell, self._skip = [], [], None, None, 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = {"text": "", "links": []}
        elif tag == "a" and self._cell is not None:
            self._cell["links"].append(dict(attrs).get("href", ""))

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        elif tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._skip:
            return
        self.parts.append(data)
        if self._cell is not None:
            self._cell["text"] += data

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.parts).split())


def _page(site: Path, url: str) -> _Text:
    p = _Text()
    p.feed((site / url / "index.html").read_text())
    return p


# ------------------------------------------------------------------ generated pages

def test_syllabus_status_matches_disk(site):
    """30 chapters, numbered 1-30; a chapter is linked and not 'planned' exactly when its
    notebook is in course/, and 'available' when its lab is in labs/source/ too."""
    rows = [r for r in _page(site, "syllabus").rows if r and r[0]["text"].strip().isdigit()]
    assert [int(r[0]["text"]) for r in rows] == list(range(1, 31))
    notebooks = {int(m.group(1)) for p in (ROOT / "course").glob("ch*/ch*.py")
                 if (m := re.match(r"ch(\d+)_", p.parent.name))}
    labs = {int(d.name[2:]) for d in (ROOT / "labs" / "source").glob("ch[0-9]*")
            if list(d.glob("*.py"))}
    assert {1, 2} <= notebooks and {1, 2} <= labs
    for num, title, lab, status in rows:
        n = int(num["text"])
        expected = ("planned" if n not in notebooks else
                    "available" if n in labs else "chapter only")
        assert status["text"].strip() == expected, (n, status["text"], expected)
        if n in notebooks:
            assert any("chapters/ch" in h for h in title["links"]), (n, title)
        else:
            assert not title["links"], (n, title)
        assert bool(lab["links"]) == (n in labs), (n, lab)
    assert "Number formats" in rows[2][1]["text"]  # the syllabus titles


@functools.cache
def _docs_module(name: str):
    """docs/<name>.py, loaded on its own (no mkdocs import), once."""
    spec = importlib.util.spec_from_file_location(f"_site_{name}", ROOT / "docs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _chapters_on_disk() -> dict[int, Path]:
    return {int(m.group(1)): p for p in (ROOT / "course").glob("ch*/ch*.py")
            if (m := re.match(r"ch(\d+)_", p.parent.name))}


def _claim_rows(site: Path, url: str) -> dict[int, list]:
    """Chapter number -> the claims page's rows for it (first cell: the chapter number)."""
    out: dict[int, list] = {}
    for r in _page(site, url).rows:
        if r and r[0]["text"].strip().isdigit():
            out.setdefault(int(r[0]["text"]), []).append(r)
    return out


NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")


@pytest.mark.parametrize("url", ["claims", "zh/claims"])
def test_claims_page_has_every_chapters_rows(site, url):
    """The claims page (and its Chinese edition) gathers the claim-vs-measurement rows of
    all 30 chapters, generated from the executed notebooks: each chapter's rows are those
    docs/claims.py reads from its notebook as the page in that language shows it (the
    Chinese rows: what the chapter said in Chinese, docs/i18n.py), each links to the
    chapter's own section in that language (an anchor its page has), and each number a
    row shows is on the chapter's page."""
    from urllib.parse import quote, urljoin

    zh = url.startswith("zh/")
    chapters = _chapters_on_disk()
    assert set(chapters) == set(range(1, 31)), sorted(chapters)
    rows = _claim_rows(site, url)
    assert set(rows) == set(chapters), sorted(set(chapters) - set(rows))
    claims, hooks_pages = _docs_module("claims"), ROOT / "build" / "site-notebooks"
    prefix = "zh/" if zh else ""
    for n, src in sorted(chapters.items()):
        sec = claims.chapter_claims(hooks_pages / ("zh" if zh else "en") / f"{src.stem}.ipynb",
                                    english=hooks_pages / "en" / f"{src.stem}.ipynb")
        assert len(rows[n]) == len(sec.rows), (n, len(rows[n]), len(sec.rows))
        page = site / prefix / "chapters" / src.stem / "index.html"
        html = page.read_text()
        anchor = claims.heading_anchor(sec.heading)
        assert f'id="{anchor}"' in html or f'id="{quote(anchor)}"' in html, (n, anchor)
        text = _Text()
        text.feed(html)
        shown = text.text
        for num, claim, measured in rows[n]:
            assert len(num["links"]) == 1, (n, num)
            target = urljoin(f"http://site/{url}/", num["links"][0])
            assert target == f"http://site/{prefix}chapters/{src.stem}/#{anchor}", (n, num["links"])
            assert claim["text"].strip() and measured["text"].strip(), (n, claim, measured)
            missing = [x for x in NUMBER.findall(measured["text"]) if x not in shown]
            assert not missing, (n, measured["text"][:120], missing)


def test_chapter_markdown_tables_render(site):
    """Each table a chapter writes in Markdown is a table on its page (nbconvert drops a
    table whose rows split on a bare |, as in "max |Δ|": write \\| inside a cell)."""
    nbs = _docs_module("notebooks")
    import nbformat

    for n, src in sorted(_chapters_on_disk().items()):
        nb = nbformat.read(nbs.cached_path(src), as_version=4)
        tables = sum(len(re.findall(r"^\|[-:| ]+\|\s*$", c.source, re.M))
                     for c in nb.cells if c.cell_type == "markdown")
        html = (site / "chapters" / src.stem / "index.html").read_text()
        assert html.count("<table") >= tables, (n, tables, html.count("<table"))


def _heading_key(text: str) -> str:
    """A heading's words, lower case, without markup: '## 5. `kv_cache_dtype` **fp8**' and
    the rendered '5. kv_cache_dtype fp8 ¶' give the same key."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)      # [text](url) -> text
    return " ".join(re.sub(r"[^\w.%+-]+", " ", text.replace("¶", "")).lower().split())


def test_chapter_page_headings_are_its_sections(site):
    """Every heading on a chapter's page is one of the chapter's own Markdown headings
    (`#`-`######` and a space), in order: a Markdown line that starts with '#' and an issue
    number ('#7805** (2024-06 ...') renders as a heading of its own on the page and fails
    here, as does a heading printed by a code cell."""
    nbs = _docs_module("notebooks")
    import nbformat

    for n, src in sorted(_chapters_on_disk().items()):
        nb = nbformat.read(nbs.cached_path(src), as_version=4)
        own = [_heading_key(m.group(2)) for c in nb.cells if c.cell_type == "markdown"
               for m in re.finditer(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", c.source, re.M)]
        html = (site / "chapters" / src.stem / "index.html").read_text()
        article = html[html.find("<article"):html.rfind("</article>")]
        page = [_heading_key(re.sub(r"<[^>]+>", " ", h)) for _, h in
                re.findall(r"<h([1-6])[^>]*>(.*?)</h\1>", article, re.S)]
        stray = [h for h in page if h not in own]
        assert not stray, (f"ch{n:02d}: headings on the page that are not the chapter's "
                           f"sections: {stray[:5]}")
        assert page == [h for h in own if h in page], (n, page, own)
        assert own[0] in page, (n, own[0])


def test_readme_course_table_lists_every_chapter_and_lab():
    """README's course table: one row per chapter, 1-30, with the chapter's notebook and
    its lab, each a file that exists."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The course and the labs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+)\. .*\| `([^`]+)` \| `([^`]+)` \|$", section, re.M)
    assert [int(n) for n, _, _ in rows] == list(range(1, 31)), [n for n, _, _ in rows]
    chapters = _chapters_on_disk()
    labs = {int(p.parent.name[2:]): p for p in (ROOT / "labs" / "source").glob("ch[0-9]*/*.py")}
    for n, nb, lab in rows:
        assert ROOT / nb == chapters[int(n)], (n, nb)
        assert ROOT / lab == labs[int(n)], (n, lab)


def test_chinese_edition(site):
    """docs/zh/: home, syllabus, claims and glossary in Chinese, marked lang="zh", the
    syllabus with all 30 chapters (Chinese titles, the same links and status as the
    English one), the glossary with every English term of the English glossary."""
    for url in ("zh", "zh/syllabus", "zh/claims", "zh/glossary"):
        html = (site / url / "index.html").read_text()
        assert '<html lang="zh"' in html, url
        text = _page(site, url).text
        assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 200, url  # Chinese prose
    assert '<html lang="en"' in (site / "index.html").read_text()
    en = [r for r in _page(site, "syllabus").rows if r and r[0]["text"].strip().isdigit()]
    zh = [r for r in _page(site, "zh/syllabus").rows if r and r[0]["text"].strip().isdigit()]
    assert [int(r[0]["text"]) for r in zh] == list(range(1, 31))
    status = {"available": "可用", "chapter only": "仅有章节", "planned": "计划中"}
    for e, z in zip(en, zh):
        assert z[3]["text"].strip() == status[e[3]["text"].strip()], (e[0]["text"], z[3]["text"])
        assert [h.split("/")[-2] for h in z[1]["links"]] == [h.split("/")[-2] for h in e[1]["links"]]
        assert bool(z[2]["links"]) == bool(e[2]["links"])
        assert re.search(r"[\u4e00-\u9fff]", z[1]["text"]) or z[1]["text"] == "GPTQ", z[1]["text"]
    terms = lambda url: {r[0]["text"].strip() for r in _page(site, url).rows[1:] if r and
                         r[0]["text"].strip() not in ("English", "中文")}
    en_terms = terms("glossary")
    zh_rows = [r for r in _page(site, "zh/glossary").rows if len(r) == 3]
    assert en_terms and en_terms <= {r[1]["text"].strip() for r in zh_rows}
    # the language selector (mkdocs-material's extra.alternate) on every page
    for url in ("", "zh/"):
        html = (site / url / "index.html").read_text()
        assert 'hreflang="zh"' in html and 'hreflang="en"' in html, url


def _output_texts(html: str) -> list[str]:
    """The text of each printed output block of a chapter page (stdout, text/plain)."""
    from html import unescape

    return [unescape(re.sub(r"<[^>]+>", "", m)) for m in
            re.findall(r'jp-RenderedText[^>]*>\s*<pre>(.*?)</pre>', html, re.S)]


def _translated(src: Path) -> bool:
    i18n = _docs_module("i18n")
    return i18n.translation_path(src).is_file() and i18n.status(src).ok


def test_chinese_chapter_pages(site):
    """Every chapter has its page in the Chinese section (zh/chapters/<chapter>/, lang
    "zh"), built from the same executed notebook as the English page: as many printed
    output blocks, each with the same numbers as its English counterpart (the sentences
    the code says in Chinese carry the English's numbers: minivllm.i18n). A chapter whose
    translation is complete shows no "not yet translated" mark and Chinese prose."""
    from minivllm.i18n import numbers

    for n, src in sorted(_chapters_on_disk().items()):
        en = (site / "chapters" / src.stem / "index.html").read_text()
        zh = (site / "zh" / "chapters" / src.stem / "index.html").read_text()
        assert '<html lang="zh"' in zh and '<html lang="en"' in en, n
        a, b = _output_texts(en), _output_texts(zh)
        assert len(a) == len(b) > 0, (n, len(a), len(b))
        for x, y in zip(a, b):
            assert numbers(x) == numbers(y), (n, x[:300], y[:300])
        article = zh[zh.find("<article"):zh.rfind("</article>")]
        if _translated(src):
            assert "尚未翻译" not in article, n
            assert len(re.findall(r"[\u4e00-\u9fff]", article)) > 1000, n


def test_chinese_lab_pages(site):
    """Every lab has its page in the Chinese section: lang "zh", the same points, no line
    of a solution or hidden test; a lab whose translation is complete shows no "not yet
    translated" mark."""
    for src in sorted((ROOT / "labs" / "source").glob("ch*/*.py")):
        lab = src.parent.name
        html = (site / "zh" / "labs" / lab / "index.html").read_text()
        assert '<html lang="zh"' in html, lab
        text = _page(site, f"zh/labs/{lab}").text
        source = src.read_text()
        total = sum(float(x) for x in re.findall(r'"points": ([0-9.]+)', source))
        assert f"总分 {total:g} 分" in text, (lab, total)
        secret = [ln.strip() for block in
                  re.findall(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", source, re.S)
                  for ln in block.splitlines() if len(ln.strip()) > 25]
        assert secret and not [ln for ln in secret if ln in text], lab
        if _translated(src):
            assert "尚未翻译" not in text, lab


def test_module_map_is_the_readmes(site):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Module map", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\| `([^`]+)`", section, re.M)
    assert len(paths) > 20
    text = _page(site, "module-map").text
    missing = [p for p in paths if p not in text]
    assert not missing, missing


def test_lab_pages_show_tasks_and_points_but_no_solutions(site):
    for src in sorted((ROOT / "labs" / "source").glob("ch*/*.py")):
        lab = src.parent.name
        text = _page(site, f"labs/{lab}").text
        source = src.read_text()
        # every task heading of the lab is on its page, with the lab's total points
        headings = re.findall(r"^# ## (Task .*)$", source, re.M)
        assert headings and all(h in text for h in headings), (lab, headings)
        total = sum(float(x) for x in re.findall(r'"points": ([0-9.]+)', source))
        assert f"{total:g} points in all" in text, (lab, total)
        # no line of a reference solution or of a hidden test reaches the page
        secret = []
        for block in re.findall(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", source, re.S):
            secret += [ln.strip() for ln in block.splitlines() if len(ln.strip()) > 25]
        assert secret, lab
        leaked = [ln for ln in secret if ln in text]
        assert not leaked, (lab, leaked[:3])
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text


class _Loads(HTMLParser):
    """The URLs a page has the browser fetch as it loads: scripts, style sheets, icons,
    images, frames, media."""

    ATTR = {"script": "src", "link": "href", "img": "src", "iframe": "src", "frame": "src",
            "source": "src", "audio": "src", "video": "src", "embed": "src", "object": "data"}

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "link" and (a.get("rel") or "").lower() in ("canonical", "alternate"):
            return  # a link to follow, not something loaded
        url = a.get(self.ATTR.get(tag, ""))
        if url:
            self.urls.append(url)


OFF_SITE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host
MATHJAX = "javascripts/mathjax/tex-mml-chtml.js"


def test_pages_load_nothing_from_other_hosts(site):
    """Pages work with the network closed: no page loads a script, style sheet, icon or
    image from another host, the site's style sheets import none, and the math renderer
    (MathJax, from the docs extra) is served with the site to every page with math."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    off_site = {}
    for page in pages:
        p = _Loads()
        p.feed(page.read_text())
        if bad := [u for u in p.urls if OFF_SITE.match(u)]:
            off_site[str(page.relative_to(site))] = bad
    assert not off_site, off_site
    for css in site.rglob("*.css"):
        bad = re.findall(r"(?:url\(\s*['\"]?|@import\s+['\"])((?:[a-z]+:)?//[^'\")\s]+)",
                         css.read_text(), re.I)
        assert not bad, (str(css.relative_to(site)), bad)
    assert (site / MATHJAX).is_file()
    assert list((site / "javascripts/mathjax/output/chtml/fonts/woff-v2").glob("*.woff"))
    with_math = [p for p in pages if 'class="arithmatex"' in p.read_text()]
    assert with_math, "no page has a formula (lab 1 does)"
    for page in with_math:
        p = _Loads()
        p.feed(page.read_text())
        assert any(u.endswith(MATHJAX) for u in p.urls), (str(page.relative_to(site)), p.urls)
    # nbconvert's CDN MathJax 2 is taken out of the chapter pages (docs/hooks.py)
    for page in site.glob("chapters/ch*/index.html"):
        assert "text/x-mathjax-config" not in page.read_text(), page


def test_api_reference_renders_docstrings(site):
    text = _page(site, "api/llm").text
    for name in ("minivllm.llm.LLM", "SamplingParams", "RequestOutput", "kv_cache_dtype"):
        assert name in text, name
    core = _page(site, "api/core").text
    for name in ("Scheduler", "KVCacheManager", "BlockPool"):
        assert name in core, name


# ------------------------------------------------------------------ in the browser

@pytest.fixture(scope="module")
def base_url(site):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown()
    httpd.server_close()


def _find(*names: str) -> str | None:
    for n in names:
        path = shutil.which(n) or (f"/usr/bin/{n}" if Path(f"/usr/bin/{n}").exists() else None)
        if path:
            return path
    return None


def _skip_unless_required(reason: str) -> None:
    """Skip with ``reason``; fail instead under MINIVLLM_REQUIRE_BROWSER=1 (CI, which
    installs the browser and its fonts)."""
    if os.environ.get("MINIVLLM_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " (MINIVLLM_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def driver():
    chromium = _find("chromium", "chromium-browser", "google-chrome")
    chromedriver = _find("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    reason = None
    if not (chromium and chromedriver):
        reason = (f"no headless browser (chromium: {chromium}, chromedriver: {chromedriver}); "
                  "install Debian's: apt-get install -y chromium chromium-driver")
    elif webdriver is None:
        reason = "selenium is not installed (the docs extra: pip install -e '.[docs]')"
    if reason:
        _skip_unless_required(reason)

    profile = tempfile.mkdtemp(prefix="minivllm-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                # the network closed: no host name resolves but the local server's
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the page's requests
    drv = webdriver.Chrome(service=Service(executable_path=chromedriver), options=opts)
    drv.set_page_load_timeout(WAIT_S)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(drv, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, WAIT_S).until(condition, message=f"timed out waiting for {what}")


def _requests(drv) -> list[tuple[str, int | None]]:
    """(url, HTTP status or None) of each request the browser made since the last call."""
    sent, status = [], {}
    for entry in drv.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        params = msg.get("params", {})
        if msg["method"] == "Network.requestWillBeSent":
            sent.append((params["requestId"], params["request"]["url"]))
        elif msg["method"] == "Network.responseReceived":
            status[params["requestId"]] = params["response"].get("status")
    return [(url, status.get(rid)) for rid, url in sent]


def _assert_site_only(drv, base_url: str):
    """Every network request since the last call went to the local site, and none failed
    there (data:, blob: and the browser's own chrome:// pages are no network)."""
    requests = [(u, s) for u, s in _requests(drv)
                if re.match(r"(?:https?|wss?|ftp):", u, re.I)]
    off_site = [u for u, _ in requests if not u.startswith(base_url)]
    assert not off_site, f"requests to other hosts: {off_site}"
    failed = [(u, s) for u, s in requests if s is not None and s >= 400]
    assert not failed, f"failed requests: {failed}"


def _header_settled(drv):
    """The header swaps the site name for the page title as one scrolls: let it settle."""
    _wait(drv, lambda d: d.execute_script(
        "const t = document.querySelectorAll('.md-header__topic');"
        "return t.length < 2 || getComputedStyle(t[0]).opacity === '0';"), "the header")


def test_home_page(driver, base_url):
    from selenium.webdriver.common.by import By

    _requests(driver)
    driver.get(base_url)
    h1 = _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), "the heading")
    assert "minivllm" in driver.title
    assert "inference precision" in h1.text.lower()
    article = driver.find_element(By.CSS_SELECTOR, "article").text
    assert "make demo" in article and "make test" in article
    driver.save_screenshot(str(SHOTS / "home.png"))
    _assert_site_only(driver, base_url)


def test_chapter_page_shows_code_and_a_plot(driver, base_url):
    from selenium.webdriver.common.by import By

    _requests(driver)
    driver.get(base_url + "chapters/ch01_fp32_baseline/")
    h1 = _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, ".jupyter-wrapper h1"),
               "the chapter's heading")
    assert h1.text.startswith("Chapter 1.")
    code = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputArea pre")]
    assert len(code) >= 5 and any("from minivllm import LLM" in c for c in code), code[:3]
    # the plots are PNG outputs of code cells; wait until the browser has decoded them
    sel = ".jp-CodeCell .jp-OutputArea-output img"
    _wait(driver, lambda d: d.execute_script(
        f"const i = [...document.querySelectorAll('{sel}')];"
        "return i.length > 0 && i.every(x => x.complete);"), "the plot images to load")
    sizes = driver.execute_script(
        f"return [...document.querySelectorAll('{sel}')].map(x => [x.naturalWidth, x.naturalHeight]);")
    assert sizes and all(w > 200 and h > 100 for w, h in sizes), sizes
    # measured outputs, not just code: the reference check printed by the chapter
    outputs = " ".join(e.text for e in driver.find_elements(
        By.CSS_SELECTOR, ".jp-CodeCell .jp-OutputArea-output pre"))
    assert re.search(r"\d", outputs) and "Traceback" not in outputs
    img = driver.find_element(By.CSS_SELECTOR, sel)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", img)
    _header_settled(driver)
    driver.save_screenshot(str(SHOTS / "chapter.png"))
    _assert_site_only(driver, base_url)


# A code line as long as the chapters' longest (100 characters).
LINE_100 = 'print(f"{kv_cache_dtype:>10} {mean_kl:9.3e} {agreement:6.1%} {first_divergence:>5}", flush=True) # !'
assert len(LINE_100) == 100


def test_chapter_code_cells_do_not_scroll_sideways(driver, base_url):
    """A chapter's code cells have room for 100 characters a line on a laptop's screen (the
    table of contents in the left sidebar, docs/stylesheets/extra.css): a 100-character
    line stays one line and no cell scrolls sideways; on a narrower screen a long line
    wraps inside its cell instead of scrolling."""
    from selenium.webdriver.common.by import By

    driver.get(base_url + "chapters/ch01_fp32_baseline/")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputArea pre"),
          "the chapter's code cells")
    measure = """
        const pres = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea pre')];
        const box = p => p.closest('.highlight-ipynb') || p;
        const scrolling = pres.filter(p => box(p).scrollWidth > box(p).clientWidth + 1)
                              .map(p => p.textContent.slice(0, 60));
        const pre = pres[0], line = document.createElement('span');
        line.textContent = arguments[0];
        pre.append('\\n', line);
        const res = {scrolling, rows: line.getClientRects().length,
                     overflow: box(pre).scrollWidth - box(pre).clientWidth,
                     width: box(pre).clientWidth};
        pre.lastChild.remove(); pre.lastChild.remove();
        return res;"""
    wide = driver.execute_script(measure, LINE_100)
    assert not wide["scrolling"], f"code cells that scroll sideways: {wide['scrolling']}"
    assert wide["rows"] == 1 and wide["overflow"] <= 1, (
        f"a 100-character line does not fit a code cell at {WINDOW[0]} px: {wide}")
    driver.set_window_size(800, WINDOW[1])
    try:
        narrow = driver.execute_script(measure, LINE_100)
    finally:
        driver.set_window_size(*WINDOW)
    assert not narrow["scrolling"] and narrow["overflow"] <= 1, narrow
    assert narrow["rows"] > 1, narrow  # wrapped, at 800 px


def _lab_with_math() -> tuple[str, list[str]]:
    """A lab whose text (its Markdown cells) has formulas, and their TeX."""
    for src in sorted((ROOT / "labs" / "source").glob("ch*/*.py")):
        markdown, lines = False, []
        for ln in src.read_text().splitlines():
            if ln.startswith("# %%"):
                markdown = "[markdown]" in ln
            elif markdown:
                lines.append(ln[2:])
        tex = re.findall(r"(?<![\\$])\$([^$\n]+)\$|\\\((.+?)\\\)", "\n".join(lines))
        if tex:
            return src.parent.name, [a or b for a, b in tex]
    pytest.fail("no lab has a formula in its text: the math check has nothing to check")


def test_lab_page_renders_math_offline(driver, base_url):
    """With the network closed, a lab page's formulas are typeset by the site's own MathJax
    (lab 1, task 1: the KL divergence): each is an mjx-container with its fonts loaded,
    no TeX source is left on the page, and nothing was asked of another host."""
    from selenium.webdriver.common.by import By

    lab, tex = _lab_with_math()
    _requests(driver)
    driver.get(f"{base_url}labs/{lab}/")
    _wait(driver, lambda d: d.execute_script(
        "const m = [...document.querySelectorAll('article .arithmatex')];"
        "const f = [...document.fonts].filter(f => f.family.includes('MJX'));"
        "return m.length > 0 && m.every(e => e.querySelector('mjx-container'))"
        " && f.some(f => f.status === 'loaded') && !f.some(f => f.status === 'loading');"),
          f"MathJax to typeset the formulas of {lab} and load its fonts")
    math = driver.execute_script(
        "return [...document.querySelectorAll('article .arithmatex')].map(e => {"
        "  const c = e.querySelector('mjx-container'), r = c.getBoundingClientRect();"
        "  return {jax: c.getAttribute('jax'), w: r.width, h: r.height,"
        "          errors: c.querySelectorAll('mjx-merror').length,"
        "          nested: e.querySelectorAll('mjx-container').length}; });")
    assert len(math) >= len(tex), (math, tex)
    for m in math:
        assert m["jax"] == "CHTML" and m["w"] > 20 and m["h"] > 5, m
        assert m["errors"] == 0 and m["nested"] == 1, m  # no TeX error, typeset once
    fonts = driver.execute_script(
        "return [...document.fonts].filter(f => f.family.includes('MJX'))"
        ".map(f => [f.family, f.status]);")
    assert any(s == "loaded" for _, s in fonts), fonts
    assert not [f for f in fonts if f[1] == "error"], fonts
    shown = driver.find_element(By.CSS_SELECTOR, "article").text
    assert "\\(" not in shown and "\\)" not in shown, "raw \\( ... \\) on the page"
    left = [t for t in tex if t.strip() in shown]
    assert not left, f"TeX shown as text: {left}"
    first = driver.find_element(By.CSS_SELECTOR, "article .arithmatex mjx-container")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", first)
    _header_settled(driver)
    driver.save_screenshot(str(SHOTS / "lab-math.png"))
    _assert_site_only(driver, base_url)


# Whether the browser draws Chinese characters as glyphs: two different characters must
# render differently, and differently from a code point no font has (the "tofu" box a
# browser draws when no installed font covers a character).
CJK_GLYPHS = """
const font = getComputedStyle(document.querySelector('article')).fontFamily;
function pixels(s) {
  const c = document.createElement('canvas'); c.width = 64; c.height = 40;
  const g = c.getContext('2d'); g.font = '28px ' + font; g.fillText(s, 2, 30);
  return Array.from(g.getImageData(0, 0, 64, 40).data).join(',');
}
const a = pixels('中'), b = pixels('文'), none = pixels(String.fromCodePoint(0x10FFFD));
return {font, distinct: a !== b, not_tofu: a !== none && b !== none};
"""


def _cjk_fonts() -> list[str] | None:
    """The font families fontconfig (which Chromium uses on Linux) has for Chinese
    (``fc-list :lang=zh family``), or None where ``fc-list`` is not installed."""
    fc_list = shutil.which("fc-list")
    if fc_list is None:
        return None
    out = subprocess.run([fc_list, ":lang=zh", "family"], capture_output=True, text=True,
                         timeout=60).stdout
    return sorted({line.strip() for line in out.splitlines() if line.strip()})


def test_chinese_page_shows_its_characters(driver, base_url):
    """The Chinese syllabus in the browser: lang="zh", Chinese headings and all 30 rows,
    and the characters drawn as glyphs, not empty boxes (a CJK font: Debian's
    fonts-noto-cjk, which `scripts/install.sh --system-browser` installs). Boxes where no
    CJK font is installed (``fc-list :lang=zh`` finds none, or there is no ``fc-list``)
    skip with that reason, once the rest has passed, unless MINIVLLM_REQUIRE_BROWSER=1
    (CI), where they fail."""
    from selenium.webdriver.common.by import By

    _requests(driver)
    driver.get(base_url + "zh/syllabus/")
    h1 = _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), "the heading")
    assert h1.text == "课程大纲"
    assert driver.execute_script("return document.documentElement.lang") == "zh"
    article = driver.find_element(By.CSS_SELECTOR, "article").text
    assert "第一阶段" in article and "第六阶段" in article
    rows = driver.find_elements(By.CSS_SELECTOR, "article table tbody tr")
    assert len(rows) == 30, len(rows)
    driver.save_screenshot(str(SHOTS / "zh-syllabus.png"))
    _assert_site_only(driver, base_url)
    glyphs = driver.execute_script(CJK_GLYPHS)
    if glyphs["distinct"] and glyphs["not_tofu"]:
        return
    fonts = _cjk_fonts()
    boxes = f"Chinese characters are drawn as empty boxes ({glyphs})"
    if not fonts:  # none, or no fc-list to ask
        found = "fc-list :lang=zh finds none" if fonts == [] else "and there is no fc-list"
        _skip_unless_required(f"no CJK font installed: {boxes}, {found}; install one: "
                              "apt-get install fonts-noto-cjk (scripts/install.sh "
                              "--system-browser does)")
    pytest.fail(f"{boxes} although fontconfig has CJK fonts: {fonts}")


def test_claims_page_in_the_browser(driver, base_url):
    """The claims page: a table per chapter, 30 of them, whose first cell leads to the
    chapter's claims section."""
    from selenium.webdriver.common.by import By

    _requests(driver)
    driver.get(base_url + "claims/")
    _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), "the heading")
    tables = driver.find_elements(By.CSS_SELECTOR, "article table")
    assert len(tables) == 30, len(tables)
    first = tables[0].find_element(By.CSS_SELECTOR, "tbody tr td a")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", tables[0])
    _header_settled(driver)
    driver.save_screenshot(str(SHOTS / "claims.png"))
    href = first.get_attribute("href")
    driver.get(href)
    anchor = href.split("#", 1)[1]
    heading = _wait(driver, lambda d: d.find_element(By.ID, anchor), "the chapter's claims section")
    assert "claim" in heading.text.lower(), heading.text
    _assert_site_only(driver, base_url)


def test_search_finds_a_chapter(driver, base_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _requests(driver)
    driver.get(base_url)
    box = _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "input.md-search__input"),
                "the search box")
    _wait(driver, lambda d: box.is_displayed() and box.is_enabled(), "the search box")
    box.click()
    box.send_keys("KV cache")

    def chapter_results(d):
        links = [a.get_attribute("href") or "" for a in
                 d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")]
        hits = [h for h in links if re.search(r"/chapters/ch\d+_", h)]
        return hits or False

    hits = _wait(driver, chapter_results, "a chapter page among the search results for 'KV cache'")
    assert hits[0].startswith(base_url)
    meta = driver.find_element(By.CSS_SELECTOR, ".md-search-result__meta").text
    assert re.search(r"\d+ matching document", meta), meta
    driver.save_screenshot(str(SHOTS / "search.png"))
    box.send_keys(Keys.ESCAPE)
    _assert_site_only(driver, base_url)


def _first_translated(kind: str) -> Path:
    srcs = (sorted(_chapters_on_disk().values()) if kind == "chapter" else
            sorted((ROOT / "labs" / "source").glob("ch*/*.py")))
    done = [s for s in srcs if _translated(s)]
    if not done:
        pytest.fail(f"no {kind} is translated (docs/i18n.py status)")
    return done[0]


def test_chinese_chapter_and_lab_in_the_browser(driver, base_url):
    """A Chinese chapter page and a Chinese lab page in the browser (screenshots
    reports/site/zh-chapter.png, zh-lab.png): lang "zh", Chinese headings, and the
    chapter's printed outputs carry the same numbers as the English page's, block by
    block. The language selector leads from the English chapter page to its Chinese
    counterpart and back."""
    from selenium.webdriver.common.by import By
    from minivllm.i18n import numbers

    src = _first_translated("chapter")
    outputs = "return [...document.querySelectorAll('.jp-OutputArea-output pre')].map(e => e.innerText)"

    def open_page(url):
        driver.get(base_url + url)
        _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), f"{url}'s heading")
        return driver.execute_script(outputs)

    _requests(driver)
    en = open_page(f"chapters/{src.stem}/")
    zh = open_page(f"zh/chapters/{src.stem}/")
    assert driver.execute_script("return document.documentElement.lang") == "zh"
    h1 = driver.find_element(By.CSS_SELECTOR, "article h1").text
    assert re.search(r"[\u4e00-\u9fff]", h1), h1
    assert len(en) == len(zh) > 0, (len(en), len(zh))
    differ = [(a[:200], b[:200]) for a, b in zip(en, zh) if numbers(a) != numbers(b)]
    assert not differ, differ
    said = sum(a != b for a, b in zip(en, zh))
    print(f"{src.stem}: {len(en)} output blocks, {said} with sentences in Chinese, numbers equal")
    driver.save_screenshot(str(SHOTS / "zh-chapter.png"))
    _assert_site_only(driver, base_url)

    lab = _first_translated("lab").parent.name
    driver.get(base_url + f"zh/labs/{lab}/")
    h1 = _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), "the lab's heading")
    assert re.search(r"[\u4e00-\u9fff]", h1.text), h1.text
    assert "总分" in driver.find_element(By.CSS_SELECTOR, "article").text
    driver.save_screenshot(str(SHOTS / "zh-lab.png"))
    _assert_site_only(driver, base_url)

    # the language selector: English chapter -> its Chinese page -> back
    for start, lang, target in ((f"chapters/{src.stem}/", "zh", f"zh/chapters/{src.stem}/"),
                                (f"zh/chapters/{src.stem}/", "en", f"chapters/{src.stem}/")):
        driver.get(base_url + start)
        link = _wait(driver, lambda d: d.find_element(
            By.CSS_SELECTOR, f'.md-select a[hreflang="{lang}"]'), "the language selector")
        driver.execute_script("arguments[0].click();", link)
        _wait(driver, lambda d: d.current_url.split("#")[0] == base_url + target,
              f"the selector to lead from {start} to {target} (now {driver.current_url})")
