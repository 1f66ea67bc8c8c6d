"""Sphinx configuration of the docs site: `make docs-site` builds it into site/.

The site renders the repository's own files, unchanged: README.md (the landing page), every
docs/*.md page, CHANGELOG.md and the executed notebooks/*.ipynb (their committed outputs, not
re-run), plus an API reference generated from the docstrings of every public module. Sphinx reads a
staging folder (the Makefile's build/docs-site-src/; a test's temporary folder) that this file fills
when the build starts (`config-inited`): copies of the pages at the paths they have in the repository,
so every relative link of the Markdown resolves as it does on GitHub, links to the other repository
files for the links into the code, and the generated pages: index.md (the README and the navigation)
and api/*.rst. No tracked file is written.

What is picked up with no edit here:

- pages: every docs/*.md, in the order of the README's "Map of the docs" table, then any page the
  map does not list (alphabetically); every notebooks/*.ipynb;
- API: every module of attnlab whose dotted path has no part starting with "_" gets a page listing
  the names of its ``__all__``. An object exported by several modules (``attnlab.attention`` from
  ``attnlab.attention.attention``; ``nn.Encoder`` from ``nn.layers``) is documented once, at the
  shortest path, and the other pages link to it. tests/test_docs_site.py checks that every public
  name has its entry in the built site.

Strict: the Makefile and the test build with ``-n -W --keep-going``, so a reference that does not
resolve (a link to a missing page or heading, an unknown attnlab name in a docstring or an
annotation) fails the build. Names of other packages (jax, numpy, flax, ...) are not linked: the
build runs without network, so there are no intersphinx inventories to resolve them against.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # attnlab from this checkout, installed or not

import attnlab  # noqa: E402

project = "attnlab"
author = "the attnlab authors"
copyright = "the attnlab authors"  # noqa: A001
release = version = attnlab.__version__

extensions = [
    "myst_nb",  # Markdown (MyST) pages and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
    # no sphinx.ext.viewcode: its links back from the code pages assume each source module's objects
    # are documented under one module, which re-exports (attnlab.explain from attnlab.dispatch) break
]
root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
# the staging folder holds only what is read, but links to the rest of the repository (for links
# into the code); those, and generated results summaries under docs/results/, are not pages
exclude_patterns = ["docs/results/**", "README.md"]  # README.md: included by index.md

# strict: every cross-reference must resolve (the Makefile and the test add -W --keep-going)
nitpicky = True
# other packages' names in signatures and docstrings: no inventory to link them to offline
nitpick_ignore_regex = [
    ("py:.*", r"(jax|jaxlib|numpy|np|jnp|flax|nnx|optax|orbax|chex|ml_collections|absl|typing|collections|abc)\b.*"),
    ("py:.*", r"(Array|ArrayLike|DTypeLike|PRNGKeyArray|Sharding|Mesh|PartitionSpec|NDArray|ndarray|dtype)"),
    ("py:.*", r"(Callable|Sequence|Iterable|Iterator|Mapping|Any|Literal|Optional|Union|Self|TypeAlias)"),
    ("py:.*", r"(int|float|bool|str|bytes|tuple|list|dict|set|frozenset|object|type|None|slice|complex)"),
    ("py:.*", r"(pathlib\.)?Path|os\.PathLike|dataclasses\..*|functools\..*|enum\..*|types\..*"),
    # attnlab's private names (a part starting with "_"): not documented, by definition
    ("py:.*", r"attnlab(\.\w+)*\._\w+.*"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
python_use_unqualified_type_names = True  # `Mask`, linked to attnlab.masks.Mask, not attnlab.masks.base.Mask
autodoc_preserve_defaults = True  # `mask=masks.full()` as written, not an object's repr
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_heading_anchors = 6  # GitHub's anchors for headings: [x](kernels.md#the-kernels)
myst_enable_extensions = ["colon_fence"]
nb_execution_mode = "off"  # the notebooks are committed with their outputs (make notebooks reruns them)
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_title = f"attnlab {version}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "use_download_button": False,
}
html_show_sourcelink = False
html_last_updated_fmt = None

# the top-level files and folders of the repository that a page may link to but that are not pages
_NOT_LINKED = {".git", ".venv", "venv", "data", "site", "build", "results", "node_modules", ".pytest_cache"}
_PAGES = ("README.md", "CHANGELOG.md", "docs", "notebooks")
_MARKER = ".attnlab-docs-site-src"


# ---------------------------------------------------------------------------------------------------
# The public API: which modules, which names, where each object is documented


def public_modules() -> dict[str, object]:
    """The public modules of attnlab, ``attnlab`` first: no part of the dotted path starts with "_",
    and the module has an ``__all__`` or is a package. (A plain module without ``__all__``, such as
    masks/base.py, is how its package is organised: the package re-exports what is public.)"""
    found = {"attnlab": attnlab}
    for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            module = importlib.import_module(info.name)
            if hasattr(module, "__all__") or info.ispkg:
                found[info.name] = module
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "attnlab", kv[0])))


def public_names(module) -> list[str]:
    """A module's public names: its ``__all__`` (a module without one exports no names of its own:
    masks/base.py, masks/graph.py ... are re-exported by their package), less the submodules."""
    return [n for n in getattr(module, "__all__", ()) if not inspect.ismodule(getattr(module, n))]


def object_key(obj, name: str):
    """What makes two public names the same documented object: a function or class is itself;
    a value (a constant, an implementation object) is its name and identity."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return ("object", id(obj))
    return ("value", name, id(obj))


def api_entries() -> dict[str, list[tuple[str, object, str]]]:
    """module -> [(name, object, where it is documented: a dotted path)], in ``__all__`` order."""
    modules = public_modules()
    home: dict[tuple, str] = {}
    for modname, module in modules.items():  # shortest path first: ties by the modules' order
        for name in public_names(module):
            key = object_key(getattr(module, name), name)
            path = f"{modname}.{name}"
            if key not in home or path.count(".") < home[key].count("."):
                home[key] = path
    return {
        modname: [(n, getattr(m, n), home[object_key(getattr(m, n), n)]) for n in public_names(m)]
        for modname, m in modules.items()
    }


# ---------------------------------------------------------------------------------------------------
# The staging folder: the pages at their repository paths, links to the rest, the generated pages


def _first_line(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph (a ". " inside ``code`` does not end it)."""
    para = inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ").strip()
    parts = re.split(r"(``.*?``)", para)  # odd parts are literals
    for i in range(0, len(parts), 2):
        end = parts[i].find(". ")
        if end >= 0:
            return "".join(parts[:i]) + parts[i][: end + 1]
    return para


def _summary(obj) -> str:
    doc = obj.__doc__ if inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj) else None
    if not isinstance(doc, str) or doc == type(obj).__doc__ and not inspect.isclass(obj):
        return ""
    return _first_line(doc).replace("|", "\\|")


def _directive(obj) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    if inspect.isroutine(obj) or callable(obj) and hasattr(obj, "__wrapped__"):
        return "autofunction"
    return "autodata"


def _api_page(modname: str, entries) -> str:
    title = modname
    parent, _, last = modname.rpartition(".")
    # a module that a name of its package shadows (the function attnlab.attention, masks.graph):
    # its page keeps the module's docstring but not its name as a target, which is the function's
    shadowed = bool(parent) and getattr(sys.modules[parent], last, None) is not sys.modules[modname]
    lines = [title, "=" * len(title), "", f".. automodule:: {modname}"]
    lines += ["   :no-index:", ""] if shadowed else [""]
    lines += [f".. currentmodule:: {modname}", ""]
    own = [(n, obj) for n, obj, path in entries if path == f"{modname}.{n}"]
    elsewhere = [(n, path) for n, obj, path in entries if path != f"{modname}.{n}"]
    if own:
        lines += [".. list-table::", "   :widths: 30 70", ""]
        for n, obj in own:
            lines += [f"   * - :py:obj:`{n}`", f"     - {_summary(obj)}"]
        lines += [""]
    if elsewhere:
        lines += ["Also exported here, documented at their shorter path:", ""]
        lines += [f"- ``{n}``: :py:obj:`{path}`" for n, path in elsewhere] + [""]
    for n, obj in own:
        kind = _directive(obj)
        lines += [f".. {kind}:: {modname}.{n}"]
        if kind == "autoclass":
            lines += ["   :members:", "   :special-members: __call__", "   :show-inheritance:"]
        elif kind == "autodata":
            lines += ["   :no-value:"]
        lines += [""]
    return "\n".join(lines)


def _api_index(entries) -> str:
    lines = [
        "API reference",
        "=============",
        "",
        "Generated from the docstrings of every public module: the names in its ``__all__``, each "
        "documented once at its shortest public path. ``import attnlab`` loads "
        + ", ".join(f"``attnlab.{m}``" for m in attnlab._LAZY_MODULES)
        + " on first use (:doc:`../docs/install`).",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - module",
        "     - what",
    ]
    for modname in entries:
        doc = _first_line(sys.modules[modname].__doc__).replace("|", "\\|")
        lines += [f"   * - :doc:`{modname}`", f"     - {doc}"]
    lines += ["", ".. toctree::", "   :hidden:", ""] + [f"   {m}" for m in entries] + [""]
    return "\n".join(lines)


def docs_pages(root: Path = ROOT) -> list[str]:
    """docs/*.md in the order of the README's map of the docs, then the ones it does not list."""
    mapped = re.findall(r"^\| \[docs/([\w.-]+)\.md\]", (root / "README.md").read_text(), re.MULTILINE)
    pages = sorted(p.stem for p in (root / "docs").glob("*.md"))
    return [p for p in mapped if p in pages] + [p for p in pages if p not in mapped]


def notebook_pages(root: Path = ROOT) -> list[str]:
    """notebooks/*.ipynb in the order the README names them (`quickstart`, ...), then the others."""
    readme = (root / "README.md").read_text()
    found = sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))
    return sorted(found, key=lambda n: (f"`{n}`" not in readme, readme.find(f"`{n}`"), n))


def _index_page(root: Path) -> str:
    notebooks = notebook_pages(root)

    def toc(caption, items):
        return "\n".join(["```{toctree}", ":hidden:", f":caption: {caption}", ":maxdepth: 2", "", *items, "```", ""])

    return "\n".join(
        [
            "```{include} README.md",
            "```",
            "",
            toc("Guides", [f"docs/{p}" for p in docs_pages(root)]),
            toc("Notebooks", [f"notebooks/{n}" for n in notebooks]),
            toc("Reference", ["api/index", "CHANGELOG"]),
        ]
    )


def _write(path: Path, text: str) -> None:
    """Writes only when the text changed, so that Sphinx rebuilds only what changed."""
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _sync(src: Path, dst: Path) -> None:
    """dst becomes a copy of src (a file or a folder), copying only files that changed."""
    if src.is_file():
        if not dst.exists() or dst.stat().st_mtime_ns != src.stat().st_mtime_ns or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        return
    dst.mkdir(parents=True, exist_ok=True)
    wanted = {p.name for p in src.iterdir() if p.name not in ("__pycache__", ".ipynb_checkpoints")}
    for old in dst.iterdir():
        if old.name not in wanted:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for name in wanted:
        _sync(src / name, dst / name)


def stage(srcdir: Path, root: Path = ROOT) -> list[str]:
    """Fills the staging folder srcdir (empty, or staged before) from the repository at root; returns
    the names of the repository entries linked there for links into the code (not pages)."""
    srcdir = Path(srcdir)
    if srcdir.resolve() in (root.resolve(), (root / "docs").resolve()):
        raise ValueError(f"srcdir must be a staging folder (e.g. build/docs-site-src), not {srcdir}")
    marker = srcdir / _MARKER
    if any(srcdir.iterdir()) and not marker.exists():
        raise ValueError(f"srcdir {srcdir} is neither empty nor a staging folder made before ({_MARKER})")
    marker.touch()
    for name in _PAGES:
        _sync(root / name, srcdir / name)
    # the rest of the repository at its path, for links into the code (download links); not pages
    linked = []
    for entry in sorted(root.iterdir()):
        if entry.name in _NOT_LINKED or entry.name in _PAGES or entry.name.startswith("."):
            continue
        if not (srcdir / entry.name).is_symlink():
            (srcdir / entry.name).symlink_to(entry.resolve())
        linked.append(entry.name)
    entries = api_entries()
    _write(srcdir / "index.md", _index_page(root))
    _write(srcdir / "api" / "index.rst", _api_index(entries))
    for modname, module_entries in entries.items():
        _write(srcdir / "api" / f"{modname}.rst", _api_page(modname, module_entries))
    for old in (srcdir / "api").glob("*.rst"):  # a module that was removed or renamed
        if old.stem != "index" and old.stem not in entries:
            old.unlink()
    return linked


def _on_config_inited(app, config) -> None:
    linked = stage(Path(app.srcdir))
    config.exclude_patterns = [*config.exclude_patterns, *linked]  # link targets, never pages


def _google_docstrings(app, what, name, obj, options, lines) -> None:
    """Before napoleon: two habits of this codebase's Google-style docstrings that napoleon misreads.

    - ``*args, **kwargs: ...`` (or ``kind, source, *args: ...``) as one argument entry: napoleon
      escapes the star of a first ``*args`` only; the others are escaped here.
    - ``vocab_sizes / input_dim / chars: ...``: several arguments with one description, written with
      slashes: napoleon takes them with commas.
    - A property's or constant's docstring is prose ("B: the product of the leading dims"), not
      napoleon's inline ``type: description``: a leading empty type keeps it prose.
    """
    for i, line in enumerate(lines):
        line = lines[i] = re.sub(r"^(\s+\w+(?: / \w+)+)(?=:(\s|$))", lambda m: m[1].replace(" / ", ", "), line)
        m = re.match(r"^(\s+)((?:\*{0,2}\w+, )+\*{0,2}\w+|\*{1,2}\w+):(\s|$)", line)
        if m and "*" in m[2]:
            lines[i] = m[1] + m[2].replace("*", "\\*") + line[m.end(2) :]
    if what in ("attribute", "data", "property") and lines:
        code = re.sub(r"``.*?``|`[^`]*`", "", lines[0])
        if re.search(r"(?<!:):(?!:)", code):
            lines[0] = ": " + lines[0]


def _drop_type_docstrings(app, what, name, obj, options, lines) -> None:
    """A constant with no doc comment of its own (``ORDER = {...}``) gets no text, not the docstring
    of its type (dict's)."""
    doc = type(obj).__doc__
    if what in ("data", "attribute") and isinstance(doc, str) and "\n".join(lines).strip() == inspect.cleandoc(doc):
        lines.clear()


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """A Flax NNX module's signature as its ``__init__`` has it: autodoc would show the metaclass's
    generic ``__call__`` (``*args: Any, **kwargs: Any``)."""
    if what != "class" or not signature or not re.fullmatch(r"\(\*args(: Any)?, \*\*kwargs(: Any)?\)", signature):
        return None
    if "__init__" not in {n for klass in obj.__mro__[:-1] for n in vars(klass)}:
        return None
    from sphinx.util.inspect import stringify_signature

    sig = inspect.signature(obj.__init__, eval_str=True)
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # less self
    return stringify_signature(sig, show_return_annotation=False), return_annotation


def _notebook_outputs_beside_the_doctrees(app) -> None:
    """myst-nb writes the notebooks' figures to <outdir>/../jupyter_execute (the repository, for
    site/): they go to the doctree folder instead (build/docs-site-doctrees/)."""
    folder = Path(app.doctreedir) / "jupyter_execute"
    app.env.mystnb_config = app.env.mystnb_config.copy(output_folder=str(folder.resolve()))


def setup(app):
    app.connect("config-inited", _on_config_inited)
    app.connect("autodoc-process-docstring", _google_docstrings, priority=400)  # napoleon's is 500
    app.connect("builder-inited", _notebook_outputs_beside_the_doctrees, priority=600)  # after myst-nb's
    app.connect("autodoc-process-signature", _constructor_signature)
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    return {"parallel_read_safe": True}
