"""Synthetic detection canvases: 1-4 small images (Fashion-MNIST items or digits) pasted on a blank canvas.

The task of a small DETR (Carion et al. 2020, arXiv 2005.12872): each canvas holds a few items at
random positions and scales; the label of an item is its class and its box. Pure numpy, seeded:
the same ``(seed, index)`` always gives the same canvas, so a training stream can be drawn by step.

Boxes are the tight box of the item's nonzero pixels after resizing, as ``(cx, cy, w, h)``
normalised by the canvas side (a pixel box ``[x0, x1) x [y0, y1)`` gives ``cx = (x0 + x1) / 2 / S``,
``w = (x1 - x0) / S``). Items are placed so that their boxes do not overlap (each placement is
retried; an item that does not fit after ``tries`` attempts is dropped, which the count records),
so every nonzero pixel of a canvas lies in exactly one box.

Legend: n canvases, S canvas side, M most items per canvas (padding: class -1, box 0).
"""

from __future__ import annotations

import numpy as np

__all__ = ["resize_nearest", "make_canvases", "boxes_to_pixels"]


def resize_nearest(image: np.ndarray, size: int) -> np.ndarray:
    """``[h, w]`` -> ``[size, size]`` by nearest-neighbour sampling (pixel centres)."""
    h, w = image.shape
    rows = np.minimum(((np.arange(size) + 0.5) * h / size).astype(int), h - 1)
    cols = np.minimum(((np.arange(size) + 0.5) * w / size).astype(int), w - 1)
    return image[rows[:, None], cols[None, :]]


def boxes_to_pixels(boxes: np.ndarray, size: int) -> np.ndarray:
    """Normalised ``(cx, cy, w, h)`` ``[..., 4]`` -> integer pixel boxes ``(x0, y0, x1, y1)``, x1/y1 exclusive."""
    b = np.asarray(boxes, np.float64) * size
    x0, y0 = b[..., 0] - b[..., 2] / 2, b[..., 1] - b[..., 3] / 2
    return np.rint(np.stack([x0, y0, x0 + b[..., 2], y0 + b[..., 3]], -1)).astype(int)


def make_canvases(
    images: np.ndarray,
    labels: np.ndarray,
    num: int,
    *,
    seed: int,
    start: int = 0,
    size: int = 64,
    min_items: int = 1,
    max_items: int = 4,
    scale: tuple[int, int] = (16, 32),
    tries: int = 50,
) -> dict[str, np.ndarray]:
    """``num`` canvases, canvas i (of the stream) drawn from ``rng([seed, start + i])``.

    Args:
        images: uint8 ``[m, h, w]`` source items (0 = background), e.g. ``fashion_mnist.load()[0]``.
        labels: int ``[m]`` their classes.
        num: number of canvases n.
        seed, start: canvas i is a function of ``(seed, start + i)`` alone (streams by step).
        size: canvas side S in pixels.
        min_items, max_items: the number of items is uniform in ``[min_items, max_items]``.
        scale: range (inclusive) of the pasted item's side in pixels, uniform.
        tries: placements tried per item before it is dropped.

    Returns:
        ``{"images": uint8 [n, S, S], "classes": int32 [n, M] (-1 pad), "boxes": float32 [n, M, 4]
        (cx, cy, w, h in [0, 1], 0 pad), "counts": int32 [n]}`` with M = ``max_items``.

    Raises:
        ValueError: naming the argument when shapes or ranges are wrong.
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim != 3 or len(images) != len(labels) or len(images) == 0:
        raise ValueError(f"make_canvases: images must be [m, h, w] with m = len(labels) > 0, got {images.shape}")
    if not 1 <= min_items <= max_items:
        raise ValueError(f"make_canvases: need 1 <= min_items <= max_items, got {min_items}, {max_items}")
    if not 1 <= scale[0] <= scale[1] <= size:
        raise ValueError(f"make_canvases: scale must be (lo, hi) with 1 <= lo <= hi <= size={size}, got {scale}")
    out_img = np.zeros((num, size, size), np.uint8)
    out_cls = np.full((num, max_items), -1, np.int32)
    out_box = np.zeros((num, max_items, 4), np.float32)
    counts = np.zeros(num, np.int32)
    for i in range(num):
        rng = np.random.default_rng([seed, start + i])
        want = int(rng.integers(min_items, max_items + 1))
        placed: list[tuple[int, int, int, int]] = []  # pixel boxes (x0, y0, x1, y1), x1/y1 exclusive
        for _ in range(want):
            j = int(rng.integers(len(images)))
            item = resize_nearest(images[j], int(rng.integers(scale[0], scale[1] + 1)))
            ys, xs = np.nonzero(item)
            if len(ys) == 0:
                continue
            item = item[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]  # tight crop: box = pasted pixels
            h, w = item.shape
            for _ in range(tries):
                y0, x0 = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
                box = (x0, y0, x0 + w, y0 + h)
                if all(box[0] >= b[2] or b[0] >= box[2] or box[1] >= b[3] or b[1] >= box[3] for b in placed):
                    break
            else:
                continue
            k = len(placed)
            placed.append(box)
            out_img[i, y0 : y0 + h, x0 : x0 + w] = item
            out_cls[i, k] = int(labels[j])
            out_box[i, k] = ((x0 + w / 2) / size, (y0 + h / 2) / size, w / size, h / size)
        counts[i] = len(placed)
    return {"images": out_img, "classes": out_cls, "boxes": out_box, "counts": counts}
