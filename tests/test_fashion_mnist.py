"""Image data: the IDX reader on hand-written files and on a slice of the real Fashion-MNIST, digits, patches."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from attnlab.data import fashion_mnist as fm


def _write_idx(path, array, code, *, gz=False, truncate=0):
    # The IDX layout written by hand: 0, 0, type code, ndim, big-endian uint32 dims, big-endian data.
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    raw = header + (body[:-truncate] if truncate else body)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_read_idx_hand_written(tmp_path, gz):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    got = fm.read_idx(_write_idx(tmp_path / "img", images, 0x08, gz=gz))
    assert got.shape == (2, 3, 4) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, images)
    ints = np.array([1, -2, 70000, -(2**31)], np.int32)  # big-endian on disk: the byte order matters
    np.testing.assert_array_equal(fm.read_idx(_write_idx(tmp_path / "i32", ints, 0x0C, gz=gz)), ints)
    floats = np.array([[0.5, -1.25]], np.float32)
    np.testing.assert_array_equal(fm.read_idx(_write_idx(tmp_path / "f32", floats, 0x0D, gz=gz)), floats)
    # A slice reads only the first items.
    np.testing.assert_array_equal(fm.read_idx(tmp_path / "img", count=1), images[:1])
    np.testing.assert_array_equal(fm.read_idx(tmp_path / "img", count=9), images)


def test_read_idx_bad_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an IDX file"):
        fm.read_idx(tmp_path / "junk")
    short = _write_idx(tmp_path / "short", np.zeros((4, 5), np.uint8), 0x08, truncate=3)
    with pytest.raises(ValueError, match="header says"):
        fm.read_idx(short)
    with pytest.raises(ValueError, match="count"):
        fm.read_idx(_write_idx(tmp_path / "ok", np.zeros(3, np.uint8), 0x08), count=-1)


def test_load_from_a_folder_of_hand_written_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images, 0x08)  # plain files work as well as .gz
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels, 0x08, gz=True)
    x, y = fm.load("test", folder=tmp_path)
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)
    with pytest.raises(ValueError, match="split"):
        fm.load("dev", folder=tmp_path)


def test_missing_folder_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_FASHION_MNIST", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make data"):
        fm.fashion_mnist_dir()


def test_real_fashion_mnist_slice():
    try:
        folder = fm.fashion_mnist_dir()
    except FileNotFoundError as e:
        pytest.skip(f"Fashion-MNIST not installed ({e})")
    n = 200
    x, y = fm.load("train", count=n)
    assert x.shape == (n, 28, 28) and x.dtype == np.uint8 and y.shape == (n,)
    # Independent parse of the same bytes: a 16-byte header for images, 8 for labels.
    path = folder / "train-images-idx3-ubyte.gz"
    if path.exists():
        with gzip.open(path) as f:
            raw = f.read(16 + n * 784)
    else:
        raw = (folder / path.stem).read_bytes()[: 16 + n * 784]
    assert struct.unpack(">4I", raw[:16]) == (0x803, 60000, 28, 28)
    np.testing.assert_array_equal(x, np.frombuffer(raw[16:], np.uint8).reshape(n, 28, 28))
    assert set(np.unique(y)) <= set(range(10)) and len(np.unique(y)) == 10
    xt, yt = fm.load("test", count=n)
    assert xt.shape == (n, 28, 28) and not np.array_equal(xt, x)


def test_load_digits_split_and_scale():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    d = fm.load_digits()
    ref = sklearn_datasets.load_digits()
    (xtr, ytr), (xte, _) = d["train"], d["test"]
    assert xtr.shape == (1347, 8, 8) and xte.shape == (450, 8, 8) and xtr.dtype == np.uint8
    np.testing.assert_array_equal(xte[1], np.round(ref.images[4] * 255 / 16))  # test = every 4th image
    np.testing.assert_array_equal(ytr[:3], ref.target[[1, 2, 3]])
    assert xtr.max() == 255


def test_patchify_against_a_loop():
    images = np.random.default_rng(1).integers(0, 256, (2, 6, 8), dtype=np.uint8)
    p = 2
    got = fm.patchify(images, p)
    assert got.shape == (2, 12, 4)
    for b in range(2):
        for r in range(3):
            for c in range(4):
                want = [images[b, r * p + i, c * p + j] for i in range(p) for j in range(p)]
                np.testing.assert_array_equal(got[b, r * 4 + c], want)
    np.testing.assert_array_equal(fm.patchify(images, 1)[..., 0], images.reshape(2, -1))
    with pytest.raises(ValueError, match="patch"):
        fm.patchify(images, 3)  # does not divide 8
    with pytest.raises(ValueError, match="images"):
        fm.patchify(images[0], 2)


def test_normalize():
    x = np.array([0, 255], np.uint8)
    np.testing.assert_allclose(fm.normalize(x, 0.5, 0.25), [-2.0, 2.0], rtol=1e-6)
