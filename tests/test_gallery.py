"""The mask gallery (docs/gallery.md): committed pictures = what the masks give, pixel by pixel."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import brute_layout

from experiments import gallery


@pytest.fixture(scope="module")
def built():
    return gallery.build()


def test_committed_gallery_is_up_to_date(built):
    for path, data in built.items():
        committed = gallery.ROOT / path
        assert committed.exists(), f"{path} missing: run make docs"
        if path.suffix == ".png":  # compare pixels (the bytes are ours too, but pixels say what differs)
            np.testing.assert_array_equal(gallery.read_png(committed.read_bytes()), gallery.read_png(data))
        else:
            assert committed.read_text() == data.decode(), f"{path} is out of date: run make docs"
    stale = {p.name for p in (gallery.ROOT / gallery.FIGURES).glob("*.png")} - {p.name for p in built}
    assert not stale, f"pictures of no gallery entry: {stale}"


def test_every_mask_kind_is_drawn():
    from attnlab import masks

    names = {e.name for e in gallery.entries()}
    assert {"causal", "window", "chunks", "dilated", "bigbird", "window_2d", "graph", "padding"} <= names
    assert {"document", "document_causal", "prefix_lm", "predicate", "predicate_arrays"} <= names
    kinds = {type(e.make()).__name__ for e in gallery.entries()}
    assert {"Predicate", "Document", "PrefixLM", "Padding", "Graph", "Window2D"} <= kinds
    assert masks.Predicate.__name__ in kinds


@pytest.mark.parametrize("name", ["causal", "document_causal", "predicate", "bigbird", "padding"])
def test_picture_shows_the_dense_mask_and_its_layout(name):
    entry = next(e for e in gallery.entries() if e.name == name)
    dense, layout = gallery.arrays(entry.make())
    np.testing.assert_array_equal(layout, brute_layout(dense, gallery.T, gallery.S, gallery.BQ, gallery.BK))
    image = gallery.read_png(gallery.png(gallery.render(dense, layout)))
    sc = gallery.SCALE
    # the centre pixel of each pair's square: dark exactly where the mask attends
    left = image[sc // 2 :: sc, sc // 2 : gallery.S * sc : sc]
    np.testing.assert_array_equal(left[..., 0] == gallery.ATTEND[0], dense)
    # the centre pixel of each tile on the right panel: the tile's kind colour
    off = gallery.S * sc + gallery.GAP
    tile = gallery.BQ * sc
    right = image[tile // 2 :: tile, off + tile // 2 :: tile]
    expect = np.array([[gallery.KIND[int(x)] for x in row] for row in layout], np.uint8)
    np.testing.assert_array_equal(right, expect)
