"""The docs site (`make docs-site`): built strictly from this checkout, then read back.

One build (Sphinx with ``-n -W --keep-going``, as the Makefile runs it) into a temporary folder; then:

- every page of the repository is there: README (the landing page), every docs/*.md, CHANGELOG.md,
  every notebooks/*.ipynb, and a page per public module of attnlab, each reachable from the landing
  page's navigation, so a page added by anyone shows up or this test names it;
- every public name (the ``__all__`` of every public module, found here independently of
  docs/conf.py) has its entry, at one of the paths that export it;
- no broken internal link or anchor on any page (every <a href>, <img src>, stylesheet and script
  that points inside the site);
- the main pages load in headless Chromium: the page's title and its first heading as the source
  writes it, no script error, every image decoded.
"""

from __future__ import annotations

import contextlib
import fcntl
import html
import html.parser
import importlib
import inspect
import json
import os
import pkgutil
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

import pytest

pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")
pytest.importorskip("myst_nb", reason="the docs extra is not installed (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # one strict build: ~30-60 s on the 2-core machine


def _browser() -> str | None:
    return next((b for b in ("/usr/bin/chromium", "chromium", "chromium-browser") if shutil.which(b)), None)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once per test run: pytest-xdist's workers share one build (under the run's
    temporary folder, behind a lock) instead of each building its own."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's folder, shared by its workers
    root = base / "docs_site"
    with open(base / "docs_site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "build.json").exists():
            (root / "src").mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "--keep-going", "-q"]
            cmd += ["-c", str(ROOT / "docs"), "-d", str(root / "doctrees"), str(root / "src"), str(root / "html")]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
            (root / "build.json").write_text(json.dumps({"rc": out.returncode, "out": out.stdout, "err": out.stderr}))
    build = json.loads((root / "build.json").read_text())
    assert build["rc"] == 0, f"the strict docs build failed:\n{build['out'][-3000:]}\n{build['err'][-6000:]}"
    assert "WARNING" not in build["err"] and "ERROR" not in build["err"], build["err"]
    assert not (root / "jupyter_execute").exists()  # myst-nb's figures went beside the doctrees
    return root / "html"


# ---------------------------------------------------------------------------------------------------
# What the site must hold, from the repository (not from docs/conf.py)


def _public_api() -> dict[str, list[str]]:
    """module -> its public names (``__all__`` less submodules) for every attnlab module with an
    ``__all__`` and no part of its path starting with "_"."""
    import attnlab

    found = {"attnlab": list(attnlab.__all__)}
    for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "__all__"):
            found[info.name] = list(module.__all__)
    return {m: [n for n in names if not inspect.ismodule(getattr(sys.modules[m], n))] for m, names in found.items()}


def _same(a, b) -> bool:
    """Two exported names are one documented object: the same function or class, or the same
    value under the same name (a constant re-exported by its package)."""
    return a is b


def _first_heading(path: Path) -> str:
    """A page's first heading as its source writes it, Markdown's backticks and emphasis removed."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:
        text = path.read_text()
    heading = re.search(r"^# (.+)$", text, re.MULTILINE)[1]
    return re.sub(r"[`*]", "", heading).strip()


def _text(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("’", "'").replace("“", '"').replace("”", '"')).strip()


# ---------------------------------------------------------------------------------------------------
# Reading the built HTML


class _Page(html.parser.HTMLParser):
    """The ids (anchors) of a page and every URL it points at (links, images, styles, scripts)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str]] = []  # (tag, url)
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if a.get(key):
                self.ids.add(a[key])
        url = {"a": a.get("href"), "img": a.get("src"), "script": a.get("src"), "link": a.get("href")}.get(tag)
        if url is not None and not (tag == "link" and a.get("rel") in ("preconnect", "dns-prefetch")):
            self.refs.append((tag, url))
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


@pytest.fixture(scope="module")
def pages(site) -> dict[Path, _Page]:
    return {p: _parse(p) for p in sorted(site.rglob("*.html")) if "_static" not in p.relative_to(site).parts}


def _internal_target(site: Path, page: Path, url: str) -> tuple[Path, str] | None:
    """(file, fragment) a URL of the page points at inside the site, None for an external one."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:", "data:")):
        return None
    path, fragment = urldefrag(url)
    target = (page.parent / unquote(urlsplit(path).path)).resolve() if path else page
    if target.is_dir():
        target = target / "index.html"
    return target, unquote(fragment)


# ---------------------------------------------------------------------------------------------------
# The checks


def test_every_page_of_the_repository_is_on_the_site_and_in_the_navigation(site, pages):
    expected = {site / "index.html": ROOT / "README.md", site / "CHANGELOG.html": ROOT / "CHANGELOG.md"}
    expected |= {site / "docs" / f"{p.stem}.html": p for p in (ROOT / "docs").glob("*.md")}
    expected |= {site / "notebooks" / f"{p.stem}.html": p for p in (ROOT / "notebooks").glob("*.ipynb")}
    missing = sorted(str(p.relative_to(site)) for p in expected if p not in pages)
    assert not missing, f"pages of the repository missing from the site: {missing}"
    api = {site / "api" / f"{m}.html" for m in _public_api()}
    missing = sorted(str(p.relative_to(site)) for p in api if p not in pages)
    assert not missing, f"public modules without an API page: {missing}"
    # in the navigation: linked from the landing page (the sidebar lists every page of the toctree)
    index = site / "index.html"
    linked = {t[0] for _, url in pages[index].refs if (t := _internal_target(site, index, url))}
    api_index = site / "api" / "index.html"
    linked |= {t[0] for _, url in pages[api_index].refs if (t := _internal_target(site, api_index, url))}
    unlinked = sorted(str(p.relative_to(site)) for p in [*expected, *api] if p not in linked and p != index)
    assert not unlinked, f"pages not in the site's navigation: {unlinked}"


def test_every_public_name_has_its_api_entry(site, pages):
    ids = set().union(*(page.ids for path, page in pages.items() if path.parent == site / "api"))
    api = _public_api()
    exported = [(m, n, getattr(sys.modules[m], n)) for m, names in api.items() for n in names]
    assert len(exported) > 200  # the walk found the package's modules
    missing = []
    for m, n, obj in exported:
        # documented under this path or under another public path of the same object
        paths = {f"{m2}.{n2}" for m2, n2, obj2 in exported if _same(obj, obj2) and (n2 == n or callable(obj))}
        if not paths & ids:
            missing.append(f"{m}.{n}")
    assert not missing, f"public names with no entry in the API reference: {missing}"
    # and each entry shows its docstring: attnlab.attention's first words are on its page
    import attnlab

    page = (site / "api" / "attnlab.html").read_text()
    first = _text(inspect.getdoc(attnlab.attention).split("\n")[0].replace("``", ""))
    assert 'id="attnlab.attention"' in page and first[:30] in _text(html.unescape(re.sub(r"<[^>]+>", "", page)))


def test_no_broken_internal_link_or_anchor_on_any_page(site, pages):
    assert len(pages) > 40
    broken = []
    for path, page in pages.items():
        for tag, url in page.refs:
            target = _internal_target(site, path, url)
            if target is None:
                continue
            file, fragment = target
            where = f"{path.relative_to(site)}: <{tag}> {url}"
            if not file.is_file():
                broken.append(f"{where} (no file)")
            elif fragment and file.suffix == ".html" and fragment not in _anchors(file, pages):
                broken.append(f"{where} (no anchor #{fragment})")
    assert not broken, "broken internal links:\n" + "\n".join(broken[:50])


def _anchors(file: Path, pages) -> set[str]:
    return pages[file].ids if file in pages else _parse(file).ids


# ---------------------------------------------------------------------------------------------------
# Headless Chromium, driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no port,
# no client package, nothing downloaded


class _Chromium:
    def __init__(self, binary: str, profile: Path):
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # the protocol runs on the browser's fds 3 (commands in) and 4 (replies out): the shell puts
        # this process's pipes there, and the browser's own stdin/stdout on /dev/null
        script = 'exec "$0" "$@" 3<&0 4>&1 </dev/null >/dev/null'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, binary, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.messages: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buf = b""
        while chunk := self.proc.stdout.read1(1 << 16):
            buf += chunk
            *done, buf = buf.split(b"\0")
            for raw in done:
                self.messages.put(json.loads(raw))

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.proc.stdin.write(json.dumps(message).encode() + b"\0")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            reply = self.messages.get(timeout=max(0.1, deadline - time.monotonic()))
            if reply.get("id") == self._id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self.messages.get(timeout=max(0.1, deadline - time.monotonic())))

    def close(self):
        with contextlib.suppress(Exception):  # closing: the process is ended below either way
            self.send("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_PAGE_STATE = """(() => {
  const h1 = document.querySelector("main h1, article h1, h1");
  return {
    title: document.title,
    h1: h1 ? h1.textContent.replace(/[#¶]\\s*$/, "").trim() : "",
    text: document.body.innerText,
    broken_images: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
    sidebar_links: document.querySelectorAll(".bd-sidebar a.reference").length,
  };
})()"""


@pytest.mark.skipif(_browser() is None, reason="no headless chromium (Debian package chromium; make browser)")
def test_the_main_pages_render_in_headless_chromium(site, tmp_path):
    main = {site / "index.html": ROOT / "README.md", site / "CHANGELOG.html": ROOT / "CHANGELOG.md"}
    main |= {site / "docs" / f"{p.stem}.html": p for p in sorted((ROOT / "docs").glob("*.md"))}
    main |= {site / "notebooks" / f"{p.stem}.html": p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    main |= {
        site / "api" / "index.html": None,
        site / "api" / "attnlab.html": None,
        site / "api" / "attnlab.masks.html": None,
    }
    browser = _Chromium(_browser(), tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.send("Page.enable", session=session)
        browser.send("Runtime.enable", session=session)
        problems = []
        for page, source in main.items():
            browser.events = [e for e in browser.events if e.get("method") != "Runtime.exceptionThrown"]
            browser.send("Page.navigate", {"url": page.as_uri()}, session=session)
            browser.wait_for("Page.loadEventFired", session)
            state = browser.send(
                "Runtime.evaluate", {"expression": _PAGE_STATE, "returnByValue": True}, session=session
            )["result"]["value"]
            name = str(page.relative_to(site))
            thrown = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
            errors = [e["params"]["exceptionDetails"] for e in thrown]
            if errors:
                problems.append(f"{name}: script errors {errors}")
            if state["broken_images"]:
                problems.append(f"{name}: images that do not load {state['broken_images']}")
            if state["sidebar_links"] < 10:
                problems.append(f"{name}: no navigation sidebar ({state['sidebar_links']} links)")
            if source is not None:
                heading = _first_heading(source)
                if _text(heading) not in _text(state["h1"]) or _text(heading) not in _text(state["title"]):
                    problems.append(f"{name}: title {state['title']!r} / heading {state['h1']!r}, expected {heading!r}")
            elif name == "api/index.html":
                if "API reference" not in state["title"] or "attnlab.masks" not in state["text"]:
                    problems.append(f"{name}: {state['title']!r} without the module table")
            elif state["h1"] != page.stem:
                problems.append(f"{name}: heading {state['h1']!r}, expected {page.stem!r}")
        assert not problems, "\n".join(problems)
        # known text: the README's quick start and the masks reference, as a reader sees them
        browser.send("Page.navigate", {"url": (site / "index.html").as_uri()}, session=session)
        browser.wait_for("Page.loadEventFired", session)
        text = browser.send(
            "Runtime.evaluate", {"expression": "document.body.innerText", "returnByValue": True}, session=session
        )["result"]["value"]
        assert "The two commands" in text and "make test" in text and "attnlab.attention(q, k, v" in text
    finally:
        browser.close()
