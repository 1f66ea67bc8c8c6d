"""DETR: canvases, GIoU, Hungarian matching, set loss, AP@0.5, per-count accuracy, model, smoke run."""

import itertools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab.data import canvases, fashion_mnist
from attnlab.nn import detr

# ------------------------------------------------------------------------------------------
# Canvases


@pytest.fixture(scope="module")
def digits():
    return fashion_mnist.load_digits()["train"]


def test_canvases_boxes_cover_pixels_inside_and_disjoint(digits):
    cv = canvases.make_canvases(*digits, 40, seed=3, size=48, min_items=1, max_items=4, scale=(10, 20))
    assert cv["images"].shape == (40, 48, 48) and cv["boxes"].shape == (40, 4, 4)
    assert set(np.unique(cv["counts"])) <= {1, 2, 3, 4} and cv["counts"].max() >= 3
    for img, cls, box, n in zip(cv["images"], cv["classes"], cv["boxes"], cv["counts"], strict=True):
        assert (cls[:n] >= 0).all() and (cls[n:] == -1).all() and (box[n:] == 0).all()
        px = canvases.boxes_to_pixels(box[:n], 48)
        assert (px >= 0).all() and (px[:, 2:] <= 48).all() and (px[:, 2:] > px[:, :2]).all()  # inside the canvas
        covered = np.zeros_like(img, int)
        for x0, y0, x1, y1 in px:
            covered[y0:y1, x0:x1] += 1
            crop = img[y0:y1, x0:x1]  # tight: every edge of the box touches a pasted pixel
            assert crop[0].any() and crop[-1].any() and crop[:, 0].any() and crop[:, -1].any()
        assert covered.max() <= 1  # boxes do not overlap
        assert (covered[img > 0] == 1).all()  # every pasted pixel lies in a box


def test_canvases_deterministic_by_seed_and_index(digits):
    a = canvases.make_canvases(*digits, 6, seed=7, size=32, scale=(8, 12))
    b = canvases.make_canvases(*digits, 6, seed=7, size=32, scale=(8, 12))
    c = canvases.make_canvases(*digits, 2, seed=7, start=4, size=32, scale=(8, 12))
    d = canvases.make_canvases(*digits, 6, seed=8, size=32, scale=(8, 12))
    chex.assert_trees_all_equal(a, b)
    for k in a:
        np.testing.assert_array_equal(a[k][4:], c[k])  # canvas i depends on (seed, start + i) only
    assert not np.array_equal(a["images"], d["images"])


def test_canvases_paste_the_resized_item(digits):
    images, labels = digits
    cv = canvases.make_canvases(images[:1], labels[:1], 1, seed=0, size=32, min_items=1, max_items=1, scale=(16, 16))
    item = canvases.resize_nearest(images[0], 16)
    ys, xs = np.nonzero(item)
    item = item[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    x0, y0, x1, y1 = canvases.boxes_to_pixels(cv["boxes"][0, 0], 32)
    np.testing.assert_array_equal(cv["images"][0, y0:y1, x0:x1], item)
    assert cv["classes"][0, 0] == labels[0]


def test_canvases_errors(digits):
    with pytest.raises(ValueError, match="min_items"):
        canvases.make_canvases(*digits, 1, seed=0, min_items=3, max_items=2)
    with pytest.raises(ValueError, match="scale"):
        canvases.make_canvases(*digits, 1, seed=0, size=32, scale=(8, 40))
    with pytest.raises(ValueError, match="images"):
        canvases.make_canvases(digits[0][0], digits[1], 1, seed=0)


# ------------------------------------------------------------------------------------------
# Boxes and GIoU


def test_giou_hand_computed():
    a = np.array([[0.0, 0, 2, 2], [0, 0, 1, 1], [0, 0, 1, 1]])
    b = np.array([[1.0, 1, 3, 3], [2, 0, 3, 1], [0, 0, 1, 1]])
    # overlap 1x1: IoU = 1 / (4 + 4 - 1) = 1/7; enclosing 3x3 = 9, so GIoU = 1/7 - (9 - 7) / 9
    # disjoint unit squares 1 apart: IoU 0, enclosing 3 x 1, union 2: GIoU = -(3 - 2) / 3; equal: 1
    expected = np.array([1 / 7 - 2 / 9, -1 / 3, 1.0])
    for xp in (np, jnp):
        g = np.asarray(detr.pairwise_giou(xp.asarray(a), xp.asarray(b)))
        np.testing.assert_allclose(np.diagonal(g), expected, rtol=1e-6)
        np.testing.assert_allclose(
            np.diagonal(np.asarray(detr.pairwise_iou(xp.asarray(a), xp.asarray(b)))), [1 / 7, 0, 1]
        )
    np.testing.assert_allclose(detr.cxcywh_to_xyxy(np.array([0.5, 0.5, 0.2, 0.4])), [0.4, 0.3, 0.6, 0.7])


def test_giou_gradient_finite_for_disjoint_and_degenerate_boxes():
    b = jnp.array([[0.2, 0.2, 0.0, 0.0], [0.8, 0.8, 0.1, 0.1]])  # a zero-area box
    t = jnp.array([[0.5, 0.5, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1]])
    g = jax.grad(lambda b: detr.pairwise_giou(detr.cxcywh_to_xyxy(b), detr.cxcywh_to_xyxy(t)).sum())(b)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


# ------------------------------------------------------------------------------------------
# Matching


def _brute_force(cost, n):
    q = cost.shape[0]
    return min(sum(cost[p[m], m] for m in range(n)) for p in itertools.permutations(range(q), int(n)))


@pytest.mark.parametrize("seed", range(5))
def test_hungarian_match_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    cost = rng.normal(size=(3, 5, 4))
    counts = np.array([4, 2, 0])
    assign = detr.hungarian_match(cost, counts)
    for b, n in enumerate(counts):
        got = assign[b]
        assert sorted(got[got >= 0].tolist()) == list(range(n))  # one query per real item, none for padding
        total = sum(cost[b, q, m] for q, m in enumerate(got) if m >= 0)
        np.testing.assert_allclose(total, _brute_force(cost[b], n) if n else 0.0)


def test_match_in_jit_equals_host_matching():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
    boxes = jnp.asarray(rng.uniform(0.2, 0.8, size=(2, 5, 4)), jnp.float32)
    classes = jnp.array([[0, 2, -1], [1, -1, -1]])
    tboxes = jnp.asarray(rng.uniform(0.2, 0.8, size=(2, 3, 4)), jnp.float32)
    got = jax.jit(detr.match)(logits, boxes, classes, tboxes)
    cost = detr.match_cost(logits, boxes, classes, tboxes)
    np.testing.assert_array_equal(got, detr.hungarian_match(np.asarray(cost), np.array([2, 1])))


def test_set_loss_zero_box_terms_for_a_permuted_perfect_prediction():
    tboxes = jnp.array([[[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.1, 0.3], [0, 0, 0, 0]]])
    classes = jnp.array([[1, 0, -1]])
    # queries 2 and 0 hold the two items exactly (in swapped order); others are far off
    boxes = jnp.array([[[0.7, 0.6, 0.1, 0.3], [0.9, 0.1, 0.05, 0.05], [0.3, 0.3, 0.2, 0.2], [0.1, 0.9, 0.05, 0.05]]])
    logits = jnp.full((1, 4, 3), -2.0).at[0, 0, 0].set(2.0).at[0, 2, 1].set(2.0).at[0, 1, 2].set(2.0)
    logits = logits.at[0, 3, 2].set(2.0)
    loss, aux = jax.jit(detr.set_loss)(logits, boxes, classes, tboxes)
    np.testing.assert_allclose([aux["l1"], aux["giou"]], [0.0, 0.0], atol=1e-6)
    assert float(aux["class_acc"]) == 1.0
    # CE: every query's target has logit 2 vs two at -2: -log softmax = log(1 + 2 e^-4) (same for all
    # queries, so the no-object weighting does not change the mean)
    np.testing.assert_allclose(aux["ce"], np.log1p(2 * np.exp(-4.0)), rtol=1e-5)
    g = jax.jit(jax.grad(lambda b: detr.set_loss(logits, b, classes, tboxes)[0]))(boxes + 0.01)
    assert np.isfinite(np.asarray(g)).all()
    assert np.abs(np.asarray(g)[0, [1, 3]]).max() == 0  # unmatched queries get no box gradient


def test_deep_set_loss_sums_each_blocks_own_matching():
    """Each block's predictions are matched on their own: the sum of set_loss per block, last block's metrics."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, 2, 4, 4)), jnp.float32)  # L=3 blocks, B=2, Q=4, C=3
    boxes = jnp.asarray(rng.uniform(0.2, 0.8, size=(3, 2, 4, 4)), jnp.float32)
    classes = jnp.array([[0, 2], [1, -1]])
    tboxes = jnp.asarray(rng.uniform(0.2, 0.8, size=(2, 2, 4)), jnp.float32)
    loss, metrics = jax.jit(detr.deep_set_loss)(logits, boxes, classes, tboxes)
    set_loss = jax.jit(detr.set_loss)  # one program for the three blocks (same shapes)
    per_block = [set_loss(logits[i], boxes[i], classes, tboxes) for i in range(3)]
    np.testing.assert_allclose(loss, sum(float(lb[0]) for lb in per_block), rtol=1e-5)
    chex.assert_trees_all_close(metrics, per_block[-1][1], rtol=1e-5)
    with pytest.raises(ValueError, match="logits must be"):
        detr.deep_set_loss(logits[0], boxes[0], classes, tboxes)


# ------------------------------------------------------------------------------------------
# Metrics


def test_average_precision_hand_made_case():
    box = [0.25, 0.25, 0.2, 0.2]
    far = [0.75, 0.75, 0.2, 0.2]
    gt_classes = np.array([[0, -1], [0, 1]])
    gt_boxes = np.array([[box, [0] * 4], [box, far]], float)
    # class 0, by score: 0.9 image 0 hit (TP), 0.8 image 1 miss (FP), 0.7 image 1 hit (TP),
    # 0.6 image 0 duplicate of a claimed item (FP). precision 1, 1/2, 2/3, 1/2; recall 1/2, 1/2, 1, 1
    # envelope at recall 1/2: 1, at 1: 2/3 -> AP = 1/2 * 1 + 1/2 * 2/3 = 5/6.
    # class 1: an item but no prediction of that class -> AP 0. Mean 5/12.
    scores = np.array([[0.9, 0.6], [0.8, 0.7]])
    pred_classes = np.array([[0, 0], [0, 0]])
    pred_boxes = np.array([[box, box], [far, box]], float)
    ap, per = detr.average_precision(scores, pred_classes, pred_boxes, gt_classes, gt_boxes)
    assert per[1] == 0.0 and per[0] == pytest.approx(5 / 6)
    assert ap == pytest.approx((5 / 6 + 0) / 2)
    pred_classes2 = np.array([[0, 0], [1, 0]])  # the far prediction now says class 1: a hit
    ap2, per2 = detr.average_precision(scores, pred_classes2, pred_boxes, gt_classes, gt_boxes)
    # class 0: 0.9 TP, 0.7 TP, 0.6 FP -> AP 1
    assert per2 == {0: pytest.approx(1.0), 1: pytest.approx(1.0)} and ap2 == pytest.approx(1.0)


def test_average_precision_iou_threshold():
    gt = np.array([[[0.5, 0.5, 0.2, 0.2]]])
    shifted = np.array([[[0.55, 0.5, 0.2, 0.2]]])  # IoU = 0.15 * 0.2 / (0.08 - 0.03) = 0.6
    args = (np.array([[1.0]]), np.array([[0]]), shifted, np.array([[0]]), gt)
    assert detr.average_precision(*args, iou=0.5)[0] == pytest.approx(1.0)
    assert detr.average_precision(*args, iou=0.7)[0] == 0.0


def test_count_accuracy_and_detections():
    # no-object logit last; image 0: queries say [class 1, none, class 0] vs truth {0, 1} -> right
    logits = np.array([[[0, 3, 0], [0, 0, 3], [3, 0, 0]], [[3, 0, 0], [0, 0, 3], [0, 0, 3]]], float)
    scores, cls, is_obj = detr.detections(logits, np.zeros((2, 3, 4)))
    np.testing.assert_array_equal(is_obj, [[1, 0, 1], [1, 0, 0]])
    np.testing.assert_array_equal(cls[is_obj], [1, 0, 0])
    gt = np.array([[0, 1], [1, -1]])  # image 1: predicted class 0, truth class 1 -> wrong
    assert detr.count_accuracy(is_obj, cls, gt) == {1: (0.0, 1), 2: (1.0, 1)}
    np.testing.assert_allclose(scores[0, 0], np.exp(3) / (np.exp(3) + 2))


# ------------------------------------------------------------------------------------------
# Model


def _jit(fn):
    """``fn(model, x)`` as one compiled program (op by op, each of the model's small ops compiled on its own)."""
    return nnx.jit(fn)


@pytest.mark.parametrize("backbone", ["patch", "cnn"])
def test_detr_shapes_and_attention(backbone):
    model = detr.DETR(
        num_classes=5, image_size=32, backbone=backbone, patch=4, cnn_layers=2, cnn_channels=8, d_model=16,
        num_heads=2, mlp_dim=32, encoder_layers=1, decoder_layers=2, num_queries=3, rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jnp.asarray(np.random.default_rng(0).uniform(size=(2, 32, 32)), jnp.float32)
    logits, boxes, weights = _jit(lambda m, x: m(x, return_weights=True))(model, x)
    s = 64  # patch: 32 / 4 = 8 -> 8 x 8 cells; cnn: 32 / 2^2 = 8 as well
    chex.assert_shape([logits, boxes], [(2, 3, 6), (2, 3, 4)])
    assert len(weights) == 2 and weights[0].shape == (2, 2, 3, s)
    np.testing.assert_allclose(np.asarray(weights[-1]).sum(-1), 1.0, rtol=1e-5)
    assert ((np.asarray(boxes) > 0) & (np.asarray(boxes) < 1)).all()
    # images are independent: the batch equals each image alone
    one = _jit(lambda m, x: m(x))(model, x[1:])
    np.testing.assert_allclose(np.asarray(one[0][0]), np.asarray(logits[1]), rtol=1e-5, atol=1e-5)


def test_detr_all_layers_reads_every_block_through_the_shared_heads():
    model = detr.DETR(num_classes=3, image_size=16, patch=4, d_model=8, num_heads=2, encoder_layers=1,
                      decoder_layers=3, num_queries=2, rngs=nnx.Rngs(2))  # fmt: skip
    x = jnp.asarray(np.random.default_rng(1).uniform(size=(2, 16, 16)), jnp.float32)
    logits, boxes = _jit(lambda m, x: m(x, all_layers=True))(model, x)
    chex.assert_shape([logits, boxes], [(3, 2, 2, 4), (3, 2, 2, 4)])
    last = _jit(lambda m, x: m(x))(model, x)
    chex.assert_trees_all_close((logits[-1], boxes[-1]), last, rtol=1e-5, atol=1e-6)

    def first_block(model, x):  # block 1 alone: run the first decoder block by hand and apply the heads
        memory = model.encoder(model.tokens(x))
        q = jnp.broadcast_to(model.queries[...], (2, *model.queries.shape))
        return model.heads(model.blocks[0](q, memory, self_mask=None, cross_mask=None))

    first = _jit(first_block)(model, x)
    chex.assert_trees_all_close((logits[0], boxes[0]), first, rtol=1e-5, atol=1e-6)


def test_detr_queries_attend_to_each_other():
    """No causal mask among object queries: changing the last query changes the first one's output."""
    model = detr.DETR(num_classes=2, image_size=16, patch=4, d_model=8, num_heads=2, encoder_layers=1,
                      decoder_layers=1, num_queries=3, rngs=nnx.Rngs(1))  # fmt: skip
    x = jnp.ones((1, 16, 16))
    call = _jit(lambda m, x: m(x))
    before = call(model, x)[0][0, 0]
    model.queries[...] = model.queries[...].at[-1].add(1.0)
    assert not np.allclose(np.asarray(call(model, x)[0][0, 0]), np.asarray(before))


def test_detr_errors():
    with pytest.raises(ValueError, match="backbone"):
        detr.DETR(num_classes=2, backbone="rnn", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="patch"):
        detr.DETR(num_classes=2, image_size=30, patch=8, rngs=nnx.Rngs(0))
    model = detr.DETR(num_classes=2, image_size=16, patch=4, d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="images"):
        model(jnp.ones((1, 8, 8)))


# ------------------------------------------------------------------------------------------
# Smoke run of the experiment


def test_smoke_run_and_report(tmp_path):
    from experiments import common
    from experiments import detr as exp

    cfg = common.load_config("experiments/configs/detr.py:smoke")
    records = exp.run(cfg, tmp_path, verbose=False)
    assert len(records) == 1 and records[0]["items"] == "1-2"
    r = records[0]
    assert 0.0 <= r["ap50"] <= 1.0 and set(r["count_accuracy"]) <= {"1", "2"} and np.isfinite(r["final_loss"])
    assert 0.0 <= r["ap50_class_agnostic"] <= 1.0 and 0.0 <= r["mean_object_prob"] <= 1.0
    assert list(r["ap50_by_items"]) == ["1-2"] and r["ap50_by_items"]["1-2"] == r["ap50"]  # all canvases have 1-2
    run_dir = tmp_path / "smoke" / "items1-2"
    ex = np.load(run_dir / "examples.npz")
    assert ex["attention"].shape == (2, 4, 64)  # 32 / 4 = 8 -> 64 cells, 4 queries
    dev = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in dev if d["split"] == "dev"] == [10, 20]
    assert exp.run(cfg, tmp_path, verbose=False) == records  # resumed: nothing runs again
    table = exp.report(tmp_path)
    assert "AP@0.5" in table and (tmp_path / "summary.md").exists()
    for name in ("predictions.png", "attention.png", "learning_curve.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_seed_spread_and_run_names():
    from experiments import detr_report as exp

    assert exp.run_name("1-2", 0) == "items1-2" and exp.run_name("1-2", 2) == "items1-2_seed2"
    rows = [
        dict(variant="cnn", items="1-2", seed=s, ap50=a, count_accuracy_all=c)
        for s, a, c in ((2, 0.70, 0.3), (0, 0.80, 0.1), (1, 0.78, 0.2))
    ] + [dict(variant="cnn", items="1-4", seed=0, ap50=0.5, count_accuracy_all=0.1)]  # one seed: no spread row
    ap, counts = np.array([0.80, 0.78, 0.70]), np.array([0.1, 0.2, 0.3])
    table = exp.seed_spread(rows)
    assert table.count("| cnn |") == 1
    want = f"| cnn | 1-2 | 0, 1, 2 | {ap.mean():.3f} ± {ap.std(ddof=1):.3f} | 0.800, 0.780, 0.700 |"
    assert want + f" {counts.mean():.3f} ± {counts.std(ddof=1):.3f} |" in table
    assert exp.seed_spread(rows[-1:]) == ""
