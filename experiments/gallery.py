r"""The mask gallery: every mask kind drawn beside the block layout the kernels read from it.

Command (part of ``make docs``; seconds)::

    python -m experiments.gallery --write   # docs/gallery.md and docs/figures/gallery/<name>.png
    python -m experiments.gallery --check   # exit 1 naming each picture or the page that differs

Each picture is one PNG of pixels computed from the mask alone (no plotting library draws it, so it is
the same on every machine): on the left ``mask.dense(T, S)`` (dark = attend, True), on the right
``mask.block_layout(T, S, bq, bk)`` at the same scale (white EMPTY: the tile is skipped, light
PARTIAL: the mask is evaluated in the tile, dark FULL: no mask is evaluated), with the tile grid
drawn over both. The page lists, per mask, the code that builds it and the tile counts.

A new mask kind: add an entry to ``GALLERY`` (name, code, constructor) and run ``make docs``.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs/gallery.md")
FIGURES = Path("docs/figures/gallery")
T = S = 64  # every picture: 64 queries x 64 keys
BQ = BK = 8  # in tiles of 8 x 8
SCALE = 4  # pixels per (query, key) pair
GAP = 12  # pixels between the two panels


def _same_doc(q_idx, k_idx, ids):  # q_idx [t, 1], k_idx [1, s]
    return ids[q_idx] == ids[k_idx]


def _stride_or_local(q_idx, k_idx):
    d = q_idx - k_idx
    return (abs(d) <= 2) | (d % 16 == 0)


_DOC_IDS = np.repeat(np.arange(4), [10, 22, 14, 18])


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    code: str  # how a user builds it (shown on the page)
    make: Callable  # () -> mask
    note: str = ""


def _gallery() -> list[Entry]:
    import jax.numpy as jnp

    from attnlab import masks

    return [
        Entry("full", "masks.full()", masks.full, "every pair: one FULL tile everywhere"),
        Entry("causal", "masks.causal()", masks.causal, "a query sees itself and the keys before it"),
        Entry("window", "masks.window(6, 6)", lambda: masks.window(6, 6), "sliding window ±6 (long speech)"),
        Entry("causal_window", "masks.window(12, 0)", lambda: masks.window(12, 0), "the 12 keys before, and itself"),
        Entry("dilated", "masks.dilated(16, 16, 4)", lambda: masks.dilated(16, 16, 4), "every 4th key within ±16"),
        Entry("chunks", "masks.chunks(16)", lambda: masks.chunks(16), "blocks of 16 attend within themselves"),
        Entry(
            "global_window",
            "masks.global_tokens([0, 1]) | masks.window(4, 4)",
            lambda: masks.global_tokens([0, 1]) | masks.window(4, 4),
            "sliding window plus two global tokens (Longformer)",
        ),
        Entry(
            "bigbird",
            "masks.bigbird(64, block_size=8, num_random=1)",
            lambda: masks.bigbird(64, block_size=8, num_random=1),
            "window + global + random blocks (BigBird)",
        ),
        Entry(
            "window_2d", "masks.window_2d(8, 1)", lambda: masks.window_2d(8, 1), "an 8 x 8 image, 3 x 3 neighbourhoods"
        ),
        Entry(
            "graph",
            "masks.graph(adjacency, self_loops=True)",
            lambda: masks.graph(np.random.default_rng(0).random((T, S)) < 0.04, self_loops=True),
            "a random graph's adjacency (a node attends to its neighbours: a GNN)",
        ),
        Entry(
            "padding",
            "masks.padding(q_lengths=[50], kv_lengths=[40])",
            lambda: masks.padding(q_lengths=jnp.array([50]), kv_lengths=jnp.array([40])),
            "a padded batch element: 50 real queries, 40 real keys",
        ),
        Entry(
            "document",
            "masks.document(segment_ids)",
            lambda: masks.document(_DOC_IDS[None]),
            "four packed documents of 10, 22, 14 and 18 tokens in one row",
        ),
        Entry(
            "document_causal",
            "masks.document(segment_ids) & masks.causal()",
            lambda: masks.document(_DOC_IDS[None]) & masks.causal(),
            "packed causal LM: causal within each document",
        ),
        Entry(
            "prefix_lm",
            "masks.prefix_lm([20])",
            lambda: masks.prefix_lm(jnp.array([20])),
            "the first 20 tokens see each other, the rest is causal",
        ),
        Entry(
            "predicate",
            "masks.predicate(lambda q, k: (abs(q - k) <= 2) | ((q - k) % 16 == 0))",
            lambda: masks.predicate(_stride_or_local),
            "any function of positions: local ±2 plus every 16th offset; its layout by evaluation",
        ),
        Entry(
            "predicate_arrays",
            "masks.predicate(lambda q, k, ids: ids[q] == ids[k], segment_ids)",
            lambda: masks.predicate(_same_doc, _DOC_IDS),
            "a function of positions and arrays (here, the documents again)",
        ),
    ]


GALLERY: list[Entry] = []  # filled on first use (building masks imports jax)


def entries() -> list[Entry]:
    if not GALLERY:
        GALLERY.extend(_gallery())
    return GALLERY


# colours (RGB)
ATTEND, _NOT = (31, 73, 125), (255, 255, 255)
KIND = {0: (255, 255, 255), 1: (170, 196, 226), 2: (31, 73, 125)}
_GRID = (200, 200, 200)


def arrays(mask) -> tuple[np.ndarray, np.ndarray]:
    """(dense bool [T, S] of the first batch element, layout int8 [T/BQ, S/BK]) of a mask."""
    dense = np.asarray(mask.dense(T, S))
    dense = np.broadcast_to(dense, dense.shape[:-2] + (T, S)).reshape(-1, T, S)[0]
    return dense.astype(bool), np.asarray(mask.block_layout(T, S, BQ, BK))


def render(dense: np.ndarray, layout: np.ndarray) -> np.ndarray:
    """uint8 RGB [T*SCALE, 2*S*SCALE + GAP, 3]: the dense mask and the layout side by side, tile grid on both."""
    left = np.where(dense[..., None], np.array(ATTEND, np.uint8), np.array(_NOT, np.uint8))
    right = np.stack([np.array(KIND[int(x)], np.uint8) for x in layout.ravel()]).reshape(*layout.shape, 3)
    right = np.repeat(np.repeat(right, BQ, 0), BK, 1)
    panels = []
    for img in (left, right):
        img = np.repeat(np.repeat(img, SCALE, 0), SCALE, 1).copy()
        img[:: BQ * SCALE, :] = np.where(img[:: BQ * SCALE, :] == 255, np.array(_GRID, np.uint8), img[:: BQ * SCALE, :])
        img[:, :: BK * SCALE] = np.where(img[:, :: BK * SCALE] == 255, np.array(_GRID, np.uint8), img[:, :: BK * SCALE])
        panels.append(img)
    gap = np.full((T * SCALE, GAP, 3), 255, np.uint8)
    return np.concatenate([panels[0], gap, panels[1]], axis=1)


def png(image: np.ndarray) -> bytes:
    """A minimal PNG (8-bit RGB, no filter, zlib level 9) of ``image``: the same bytes on every machine."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    h, w, _ = image.shape
    raw = b"".join(b"\x00" + image[r].tobytes() for r in range(h))
    header = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def read_png(data: bytes) -> np.ndarray:
    """The inverse of ``png`` (8-bit RGB, filter 0 only): for the tests."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"  # noqa: S101 (tests only)
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    if rows[:, 0].any():
        raise ValueError("read_png: only filter type 0 is supported")
    return rows[:, 1:].reshape(h, w, 3)


def page(stats: list[tuple[Entry, np.ndarray, np.ndarray]]) -> str:
    lines = [
        "# Mask gallery",
        "",
        "Every mask kind of `attnlab.masks`, built-in and from a function, drawn from the mask object itself:",
        f"on the left `mask.dense({T}, {S})` (dark = attend), on the right",
        f"`mask.block_layout({T}, {S}, {BQ}, {BK})`, the tiles the fast kernels read (white EMPTY: skipped;",
        "light PARTIAL: the mask is evaluated inside the tile; dark FULL: no mask is evaluated). Masks with",
        "data (padding, documents) are shown for their first batch element.",
        "",
        "Regenerate with `make docs` (`python -m experiments.gallery --write`); `tests/test_gallery.py`",
        "checks every picture against the masks. Generated file: edit `experiments/gallery.py`, not this page.",
        "",
    ]
    for e, dense, layout in stats:
        counts = {k: int((layout == v).sum()) for k, v in (("EMPTY", 0), ("PARTIAL", 1), ("FULL", 2))}
        tiles = ", ".join(f"{n} {k}" for k, n in counts.items())
        lines += [
            f"## {e.name}",
            "",
            f"`{e.code}`: {e.note}. Allowed pairs {int(dense.sum()):,} of {T * S:,}; tiles: {tiles}.",
            "",
            f"![{e.name}: dense mask and block layout](figures/gallery/{e.name}.png)",
            "",
        ]
    return "\n".join(lines)


def build() -> dict[Path, bytes]:
    """Path (relative to the repository) -> the file's bytes, for the page and every picture."""
    stats = []
    files: dict[Path, bytes] = {}
    for e in entries():
        dense, layout = arrays(e.make())
        stats.append((e, dense, layout))
        files[FIGURES / f"{e.name}.png"] = png(render(dense, layout))
    files[PAGE] = page(stats).encode()
    return files


FLAGS = flags.FLAGS


def define_flags():
    """The command-line flags, defined only when run as a program (so importing this module is free)."""
    flags.DEFINE_bool("write", False, "Write docs/gallery.md and the pictures.")
    flags.DEFINE_bool("check", False, "Exit 1 when a committed file differs from what the masks give.")


def main(argv):
    del argv
    files = build()
    if FLAGS.write:
        (ROOT / FIGURES).mkdir(parents=True, exist_ok=True)
        for stale in (ROOT / FIGURES).glob("*.png"):
            if stale.relative_to(ROOT) not in files:
                stale.unlink()
        for path, data in files.items():
            (ROOT / path).write_bytes(data)
        print(f"wrote {PAGE} and {len(files) - 1} pictures under {FIGURES}")
    if FLAGS.check:
        bad = [str(p) for p, data in files.items() if not (ROOT / p).exists() or (ROOT / p).read_bytes() != data]
        if bad:
            print("out of date (run make docs): " + ", ".join(bad))
            sys.exit(1)
        print(f"{PAGE} and its {len(files) - 1} pictures are up to date")


if __name__ == "__main__":
    define_flags()
    app.run(main)
