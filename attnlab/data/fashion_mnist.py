"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, arXiv 1708.07747) from the Debian package, and small image sets.

``make data`` runs ``apt-get install -y dataset-fashion-mnist``, which puts the four IDX files of
the dataset, gzipped, in ``/usr/share/datasets/fashion-mnist/``:
``train-images-idx3-ubyte.gz`` (60,000 x 28 x 28 uint8), ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz`` (10,000 x 28 x 28) and ``t10k-labels-idx1-ubyte.gz``. Set
``ATTNLAB_FASHION_MNIST`` to read them from another folder (plain or gzipped files).

IDX format (LeCun's MNIST page): 4 magic bytes ``0, 0, dtype code, ndim``, then ``ndim``
big-endian uint32 dimensions, then the values in C order, big-endian. Codes: 0x08 uint8,
0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64.

Also here: ``load_digits`` (scikit-learn's bundled 8 x 8 digits, 1,797 images, the tiny set for
tests) and ``patchify`` (an image as a sequence of patch vectors, ViT's tokens).

Legend: B images, Hi x Wi pixels, P patch size, T = (Hi / P) (Wi / P) tokens.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = [
    "PACKAGE",
    "CLASSES",
    "FILES",
    "fashion_mnist_dir",
    "read_idx",
    "load",
    "load_digits",
    "patchify",
    "normalize",
]

PACKAGE = "dataset-fashion-mnist"
DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# Mean and standard deviation of the training pixels (/255), measured on the 60,000 train images.
MEAN, STD = 0.2860, 0.3530


def fashion_mnist_dir() -> Path:
    """The folder with the IDX files; raises FileNotFoundError saying how to install them."""
    folder = Path(os.environ.get("ATTNLAB_FASHION_MNIST", DEFAULT_DIR))
    if not any((folder / (name + ext)).exists() for name in FILES["train"] for ext in ("", ".gz")):
        raise FileNotFoundError(
            f"Fashion-MNIST IDX files not found in {folder}: run `make data` (as root it runs "
            f"`apt-get install -y {PACKAGE}`), or set ATTNLAB_FASHION_MNIST to a folder with them"
        )
    return folder


def _open(path: Path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_idx(path, *, count: int | None = None) -> np.ndarray:
    """Reads an IDX file (plain or gzipped, found by its magic bytes) into a numpy array.

    Args:
        path: the file.
        count: read only the first ``count`` items along the first axis (a slice, without
            reading the rest of the file).

    Returns:
        array of shape ``[n, *dims]`` (n = count when given) in native byte order.

    Raises:
        ValueError: the header is not IDX, or the file is shorter than its header says.
    """
    path = Path(path)
    with _open(path) as f:
        magic = f.read(4)
        if len(magic) != 4 or magic[:2] != b"\x00\x00" or magic[2] not in _DTYPES or magic[3] == 0:
            raise ValueError(f"read_idx: {path} is not an IDX file (magic bytes {magic!r})")
        ndim = magic[3]
        header = f.read(4 * ndim)
        if len(header) != 4 * ndim:
            raise ValueError(f"read_idx: {path} ends inside its header ({ndim} dimensions expected)")
        shape = tuple(int(d) for d in np.frombuffer(header, ">u4"))
        if count is not None:
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(f"read_idx: count must be an int >= 0, got {count!r}")
            shape = (min(int(count), shape[0]), *shape[1:])
        dtype = np.dtype(_DTYPES[magic[2]])
        nbytes = int(np.prod(shape)) * dtype.itemsize
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise ValueError(f"read_idx: {path} has {len(data)} bytes of data, its header says {nbytes} (shape {shape})")
    return np.frombuffer(data, dtype).reshape(shape).astype(dtype.newbyteorder("="))


def _find(folder: Path, name: str) -> Path:
    for candidate in (folder / (name + ".gz"), folder / name):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{name}(.gz) not in {folder}: run `make data` (apt-get install -y {PACKAGE})")


def load(split: str = "train", *, count: int | None = None, folder=None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST images uint8 ``[n, 28, 28]`` (0 = background) and labels uint8 ``[n]`` (0-9, ``CLASSES``).

    Args:
        split: ``"train"`` (60,000) or ``"test"`` (10,000), the dataset's own split.
        count: only the first ``count`` examples.
        folder: the IDX folder (default: ``fashion_mnist_dir()``).
    """
    if split not in FILES:
        raise ValueError(f"load: split must be one of {tuple(FILES)}, got {split!r}")
    folder = fashion_mnist_dir() if folder is None else Path(folder)
    images = read_idx(_find(folder, FILES[split][0]), count=count)
    labels = read_idx(_find(folder, FILES[split][1]), count=count)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"load: images {images.shape} and labels {labels.shape} do not match")
    return images, labels


def load_digits(*, test_fraction: float = 0.25) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's bundled 8 x 8 digits (1,797 images, values 0-16, 10 classes), rescaled to uint8 0-255.

    Fixed split: image i goes to test when ``i % round(1 / test_fraction) == 0``, else train
    (4 -> 450 test, 1,347 train). Returns ``{"train": (images, labels), "test": (...)}``.
    """
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    images = np.round(d.images * (255 / 16)).astype(np.uint8)  # [1797, 8, 8]
    labels = d.target.astype(np.uint8)
    every = round(1 / test_fraction)
    test = np.arange(len(labels)) % every == 0
    return {"train": (images[~test], labels[~test]), "test": (images[test], labels[test])}


def patchify(images: np.ndarray, patch: int) -> np.ndarray:
    """``[B, Hi, Wi]`` -> ``[B, T, P*P]``: non-overlapping P x P patches, row-major, each flattened row-major.

    Patch (r, c) is token ``r * (Wi / P) + c``, the order ``positional.sinusoidal_2d`` and
    ``masks.window_2d`` assume. ``patch=1`` gives pixels as tokens ``[B, Hi*Wi, 1]``.
    """
    images = np.asarray(images)
    if images.ndim != 3:
        raise ValueError(f"patchify: images must be [B, H, W], got shape {images.shape}")
    b, h, w = images.shape
    if isinstance(patch, bool) or not isinstance(patch, (int, np.integer)) or patch < 1 or h % patch or w % patch:
        raise ValueError(f"patchify: patch must be a positive int dividing H={h} and W={w}, got {patch!r}")
    x = images.reshape(b, h // patch, patch, w // patch, patch)  # [B, Hg, P, Wg, P]
    return x.transpose(0, 1, 3, 2, 4).reshape(b, (h // patch) * (w // patch), patch * patch)


def normalize(x: np.ndarray, mean: float = MEAN, std: float = STD) -> np.ndarray:
    """uint8 pixels -> float32 ``(x / 255 - mean) / std``."""
    return ((np.asarray(x, np.float32) / 255.0 - mean) / std).astype(np.float32)
