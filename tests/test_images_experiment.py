"""Images as sequences: the image models against hand compositions, attention distance, and the smoke run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import masks, nn, positional
from experiments import images
from experiments.configs import images as images_config


def test_encoder_2d_positions_and_local_mask_match_hand_composition():
    enc = nn.Encoder(
        input_dim=4,
        d_model=8,
        num_layers=1,
        num_heads=2,
        posenc=positional.Sinusoidal2D(3, 4),
        attention_mask=masks.window_2d(4, 1),
        rngs=nnx.Rngs(0),
    )
    x = jax.random.normal(jax.random.key(1), (2, 12, 4))
    h = enc.embed(x) + positional.sinusoidal_2d(3, 4, 8)
    for blk in enc.blocks:
        h = blk(h, mask=masks.window_2d(4, 1))
    y, weights = enc(x, return_weights=True)
    np.testing.assert_allclose(y, enc.ln_f(h), atol=1e-5)
    # The mask really restricts attention: no weight outside each token's 3 x 3 neighbourhood.
    allowed = np.asarray(masks.window_2d(4, 1).dense(12, 12))
    assert np.all(np.asarray(weights[0])[:, :, ~allowed] == 0)
    with pytest.raises(ValueError, match="grid"):
        enc(jnp.ones((1, 10, 4)))
    with pytest.raises(ValueError, match=r"posenc='sinusoidal_2d' needs \['height', 'width'\]"):
        nn.Encoder(input_dim=4, d_model=8, num_layers=1, num_heads=2, posenc="sinusoidal_2d", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_mask"):
        nn.Encoder(
            input_dim=4, d_model=8, num_layers=1, num_heads=2, attention_mask=np.eye(3, dtype=bool), rngs=nnx.Rngs(0)
        )


def test_cnn_on_a_grid_is_a_2d_convolution():
    cnn = nn.CNN(input_dim=2, d_model=3, num_layers=1, kernel_size=3, grid=(4, 5), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (1, 20, 2))
    e = np.asarray(cnn.embed(x))[0].reshape(4, 5, 3)  # [Hg, Wg, D]
    kern = np.asarray(cnn.convs[0].kernel[...])  # [3, 3, Din, Dout]
    bias = np.asarray(cnn.convs[0].bias[...])
    pad = np.pad(e, ((1, 1), (1, 1), (0, 0)))
    conv = np.zeros((4, 5, 3))
    for r in range(4):  # cross-correlation with zero padding, written out
        for c in range(5):
            conv[r, c] = np.einsum("ijd,ijde->e", pad[r : r + 3, c : c + 3], kern) + bias
    want = cnn.ln_f(jnp.asarray(e.reshape(1, 20, 3) + np.asarray(jax.nn.gelu(conv.reshape(1, 20, 3)))))
    np.testing.assert_allclose(cnn(x), want, atol=1e-5)
    with pytest.raises(ValueError, match="grid"):
        cnn(jnp.ones((1, 12, 2)))


def test_attention_distance_by_hand():
    d = images.token_distances((2, 3), 4)  # a 2 x 3 grid of 4-pixel patches
    assert d[0, 5] == pytest.approx(4 * np.hypot(1, 2)) and d[1, 4] == 4.0 and d[2, 2] == 0.0
    w = np.zeros((1, 2, 6, 6))
    w[0, 0, :, 0] = 1.0  # head 0: every query looks at token 0
    w[0, 1] = np.eye(6)  # head 1: every query looks at itself
    np.testing.assert_allclose(images.mean_distance(w, d), [d[:, 0].mean(), 0.0])
    ref = images.reference_distances((3, 3), 1)
    # 3 x 3 grid, uniform over a 3 x 3 window: centre (4 n + 4 d)/9, edges (3 n + 2 d)/6, corners (2 n + d)/4
    n, diag = 1.0, np.sqrt(2)
    want = ((4 * n + 4 * diag) / 9 + 4 * (3 * n + 2 * diag) / 6 + 4 * (2 * n + diag) / 4) / 9
    assert ref["uniform_3x3"] == pytest.approx(want)
    assert ref["uniform_full"] == pytest.approx(images.token_distances((3, 3), 1).mean())


def test_pixel_model_attention_stays_in_its_window():
    m = images_config.get_config("pixel").models["pixel"]
    m.update(d_model=8, num_layers=1, num_heads=2, mlp_dim=16, radius=1)
    model = images.build_model(m, (4, 4), 10, seed=0)  # a 4 x 4 "image", 16 pixel tokens, 3 x 3 windows
    tokens = np.random.default_rng(0).integers(0, 256, (8, 16, 1), dtype=np.uint8)
    d = np.asarray(images.attention_distance(model, tokens, 0.5, 0.3, (4, 4), 1))
    assert d.shape == (1, 2)
    # Uniform attention over the 3 x 3 windows gives the reference; the learned weights are not uniform,
    # but no weight can reach further than one diagonal step.
    assert np.all(d > 0.5) and np.all(d <= np.sqrt(2) + 1e-6)
    assert images.reference_distances((4, 4), 1)["uniform_3x3"] < np.sqrt(2)


def test_batches_are_deterministic_and_cover_each_epoch():
    tokens = np.arange(10, dtype=np.uint8)[:, None, None] * np.ones((1, 2, 1), np.uint8)
    labels = np.arange(10, dtype=np.uint8)
    fn = images.make_batch_fn(tokens, labels, 4, seed=3, mean=0.0, std=1.0)
    seen = np.concatenate([fn(s)["y"] for s in range(1, 6)])  # 20 positions = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    np.testing.assert_array_equal(fn(4)["y"], images.make_batch_fn(tokens, labels, 4, 3, 0.0, 1.0)(4)["y"])
    b = fn(2)
    np.testing.assert_allclose(b["x"][:, 0, 0] * 255, b["y"], atol=1e-4)  # tokens follow their labels
    sub = images.subset(100, 30, seed=1)
    assert len(set(sub)) == 30 and set(images.subset(100, 30, seed=2)) != set(sub)
    np.testing.assert_array_equal(images.subset(100, 500, seed=1), np.arange(100))


def test_config_variants():
    for v in images_config.VARIANTS:
        cfg = images_config.get_config(v)
        assert cfg.variant == v and len(cfg.train.steps) == len(cfg.sizes)
    assert images_config.get_config("pixel").models["pixel"].patch == 1
    eq = images_config.get_config("epochs")  # the same number of epochs at every size
    epochs = [steps * eq.train.batch_size / n for steps, n in zip(eq.train.steps, eq.sizes, strict=True)]
    np.testing.assert_allclose(epochs, images_config.EPOCHS, rtol=0.01)
    assert tuple(eq.sizes) == (1000, 5000, 20000) and set(eq.models) == {"vit", "cnn"}
    with pytest.raises(ValueError, match="unknown"):
        images_config.get_config("nope")


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    pytest.importorskip("sklearn")
    cfg = images_config.get_config("smoke")
    results = images.run(cfg, tmp_path, verbose=False)
    assert len(results) == 2 * 2 * 2  # models x sizes x seeds
    run_dir = tmp_path / "smoke" / "vit-n200-s1"
    for name in ("config.json", "metrics.jsonl", "result.json"):
        assert (run_dir / name).exists(), name
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 8, 12]
    for r in results:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["test_examples"] == 450
        if r["model"] == "vit":
            d = np.asarray(r["attention_distance"])
            assert d.shape == (1, 2) and np.all(d > 0) and np.all(d <= images.token_distances((4, 4), 2).max())
    # A second run reads the finished runs back instead of training again.
    assert images.run(cfg, tmp_path, verbose=False) == results
    table = images.report(tmp_path)
    assert "| smoke | vit | 200 | 2 |" in table
    for name in ("summary.md", "accuracy_vs_size.png", "attention_distance.png"):
        assert (tmp_path / name).exists(), name
    assert "The CNN's lead over the ViT" in table


def test_gap_table_by_hand():
    rows = [
        dict(variant="epochs", model=m, size=n, mean=acc, std=0.0, seeds=3, epochs=5.0, steps=n * 5 // 64)
        for m, n, acc in (("cnn", 1000, 0.70), ("vit", 1000, 0.65), ("cnn", 5000, 0.80), ("vit", 5000, 0.79))
    ] + [dict(variant="pixel", model="pixel", size=5000, mean=0.5, std=0.0, seeds=1, epochs=1.3, steps=200)]
    text = images.gap_table(rows)
    assert "| epochs | 1,000 | 5.0 | 78 | 70.00 | 65.00 | +5.00 |" in text
    assert "| epochs | 5,000 | 5.0 | 390 | 80.00 | 79.00 | +1.00 |" in text
    assert "pixel" not in text  # no CNN beside it
    assert images.gap_table(rows[-1:]) == ""
