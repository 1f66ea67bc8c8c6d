"""A small DETR (Carion et al. 2020, "End-to-End Object Detection with Transformers", arXiv 2005.12872).

An image is a sequence of patch vectors (or of the cells of a small CNN's feature map) with 2-D
sinusoidal positions, encoded by ``attnlab.nn.Encoder``; Q learned object queries attend to each
other (no causal mask) and to the encoded image through ``DecoderBlock``s; each query predicts a
class (or "no object") and a box ``(cx, cy, w, h)`` in [0, 1]. Training is set prediction: a
Hungarian matching between queries and ground-truth items (``scipy.optimize.linear_sum_assignment``
on the host, called from inside the jitted loss by ``jax.pure_callback`` on a cost with no gradient)
decides which query answers for which item; the loss is class cross-entropy (the no-object class
down-weighted) + L1 + GIoU on the matched boxes.

Also here: box conversions, pairwise IoU/GIoU (Rezatofighi et al. 2019, arXiv 1902.09630), the
numpy matcher, AP at an IoU threshold and per-count accuracy.

Legend: B images, S encoder positions (grid cells), Q queries, M most ground-truth items per image
(padding class -1), C classes (logit C is "no object"), D model dim, N heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attnlab import positional
from attnlab.nn.layers import Encoder, split_key
from attnlab.nn.seq2seq import DecoderBlock

__all__ = [
    "DETR",
    "cxcywh_to_xyxy",
    "pairwise_iou",
    "pairwise_giou",
    "hungarian_match",
    "match_cost",
    "match",
    "set_loss",
    "deep_set_loss",
    "average_precision",
    "count_accuracy",
    "detections",
]

# ------------------------------------------------------------------------------------------
# Boxes


def cxcywh_to_xyxy(b):
    """``(cx, cy, w, h)`` ``[..., 4]`` -> ``(x0, y0, x1, y1)`` ``[..., 4]`` (works on jax and numpy arrays)."""
    cx, cy, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    xp = jnp if isinstance(b, jax.Array) else np
    return xp.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def _iou_union(a, b, xp):
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])  # [..., P]
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # [..., R]
    lo = xp.maximum(a[..., :, None, :2], b[..., None, :, :2])  # [..., P, R, 2]
    hi = xp.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    wh = xp.clip(hi - lo, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a[..., :, None] + area_b[..., None, :] - inter
    return inter / xp.maximum(union, 1e-9), union


def pairwise_iou(a, b):
    """IoU of boxes ``a [..., P, 4]`` and ``b [..., R, 4]`` in ``(x0, y0, x1, y1)`` -> ``[..., P, R]``."""
    xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
    return _iou_union(a, b, xp)[0]


def pairwise_giou(a, b):
    """Generalised IoU (arXiv 1902.09630): ``IoU - |C \\ (A u B)| / |C|``, C the smallest enclosing box.

    ``a [..., P, 4]``, ``b [..., R, 4]`` in ``(x0, y0, x1, y1)`` -> ``[..., P, R]`` in [-1, 1]; 1 for
    equal boxes, tending to -1 for tiny boxes far apart. Differentiable (used in the loss).

    Example:
        >>> pairwise_giou(jnp.array([[0.0, 0, 1, 1]]), jnp.array([[2.0, 0, 3, 1]]))  # IoU 0, C 3x1
        Array([[-0.33333334]], dtype=float32)
    """
    xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
    iou, union = _iou_union(a, b, xp)
    lo = xp.minimum(a[..., :, None, :2], b[..., None, :, :2])
    hi = xp.maximum(a[..., :, None, 2:], b[..., None, :, 2:])
    wh = xp.clip(hi - lo, 0, None)
    enclose = wh[..., 0] * wh[..., 1]
    return iou - (enclose - union) / xp.maximum(enclose, 1e-9)


# ------------------------------------------------------------------------------------------
# Matching


def hungarian_match(cost: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Minimum-cost one-to-one assignment per image, on the host.

    Args:
        cost: ``[B, Q, M]`` cost of query q answering for item m (Q >= M).
        counts: int ``[B]``: items ``0 .. counts[b] - 1`` of image b are real, the rest padding.

    Returns:
        int32 ``[B, Q]``: the item each query is matched to, -1 for "no object".
    """
    from scipy.optimize import linear_sum_assignment  # scipy (via scikit-learn, the experiments extra)

    cost = np.asarray(cost, np.float64)
    out = np.full(cost.shape[:2], -1, np.int32)
    for b, n in enumerate(np.asarray(counts)):
        if n:
            rows, cols = linear_sum_assignment(cost[b, :, :n])
            out[b, rows] = cols
    return out


def match_cost(logits, boxes, classes, target_boxes, *, w_class=1.0, w_l1=5.0, w_giou=2.0):
    """DETR's matching cost ``[B, Q, M]``: ``-w_class p(class) + w_l1 L1 - w_giou GIoU`` (fp32).

    ``logits [B, Q, C+1]``, ``boxes [B, Q, 4]``, ``classes int [B, M]`` (-1 pad), ``target_boxes [B, M, 4]``.
    """
    prob = jax.nn.softmax(logits.astype(jnp.float32), -1)
    p = jnp.take_along_axis(prob, jnp.maximum(classes, 0)[:, None, :], -1)  # [B, Q, M]
    l1 = jnp.abs(boxes[:, :, None, :] - target_boxes[:, None, :, :]).sum(-1)  # [B, Q, M]
    giou = pairwise_giou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(target_boxes))
    return -w_class * p + w_l1 * l1 - w_giou * giou


def match(logits, boxes, classes, target_boxes, **weights) -> jax.Array:
    """Hungarian matching inside jit: the cost (no gradient) goes to ``hungarian_match`` on the host.

    Returns int32 ``[B, Q]``: matched item per query, -1 for none.
    """
    cost = jax.lax.stop_gradient(match_cost(logits, boxes, classes, target_boxes, **weights))
    counts = (classes >= 0).sum(-1)
    out = jax.ShapeDtypeStruct(logits.shape[:2], jnp.int32)
    return jax.pure_callback(hungarian_match, out, cost, counts, vmap_method="sequential")


def set_loss(logits, boxes, classes, target_boxes, *, eos_coef=0.1, w_class=1.0, w_l1=5.0, w_giou=2.0):
    """DETR's set loss and metrics.

    Class cross-entropy over all queries (unmatched ones should say "no object", weight
    ``eos_coef``), averaged with those weights; L1 and ``1 - GIoU`` over matched boxes, averaged
    over the batch's ground-truth items. Assumes ground-truth items are packed first (class -1 after).

    Returns:
        ``(w_class CE + w_l1 L1 + w_giou (1 - GIoU), {"ce", "l1", "giou", "class_acc"})``.
    """
    num_classes = logits.shape[-1] - 1
    assign = match(logits, boxes, classes, target_boxes, w_class=w_class, w_l1=w_l1, w_giou=w_giou)  # [B, Q]
    matched = assign >= 0
    idx = jnp.maximum(assign, 0)
    tcls = jnp.where(matched, jnp.take_along_axis(classes, idx, 1), num_classes)  # [B, Q]
    tbox = jnp.take_along_axis(target_boxes, idx[..., None], 1)  # [B, Q, 4]
    weight = jnp.where(matched, 1.0, eos_coef)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tcls)
    ce = (ce * weight).sum() / weight.sum()
    n = jnp.maximum(matched.sum(), 1)
    l1 = jnp.where(matched[..., None], jnp.abs(boxes - tbox), 0.0).sum() / n
    giou = jnp.diagonal(pairwise_giou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(tbox)), axis1=-2, axis2=-1)  # [B, Q]
    giou_loss = jnp.where(matched, 1.0 - giou, 0.0).sum() / n
    acc = (logits.argmax(-1) == tcls).mean()
    loss = w_class * ce + w_l1 * l1 + w_giou * giou_loss
    return loss, {"ce": ce, "l1": l1, "giou": giou_loss, "class_acc": acc}


def deep_set_loss(logits, boxes, classes, target_boxes, **kw):
    """DETR's auxiliary decoding losses: ``set_loss`` after every decoder block, summed.

    ``logits [L, B, Q, C+1]``, ``boxes [L, B, Q, 4]`` (``DETR(..., all_layers=True)``): each block's
    predictions (through the shared heads) get their own Hungarian matching and set loss, so the
    early blocks are trained to detect too (Carion et al. 2020, section 3.2: it helps the model
    output the right number of objects). Returns the summed loss and the last block's metrics.
    """
    if logits.ndim != 4 or boxes.ndim != 4 or logits.shape[:3] != boxes.shape[:3]:
        raise ValueError(
            f"deep_set_loss: logits must be [L, B, Q, C+1] and boxes [L, B, Q, 4] with the same L, B, Q; "
            f"got {logits.shape} and {boxes.shape}"
        )
    total = 0.0
    for layer in range(logits.shape[0]):
        loss, metrics = set_loss(logits[layer], boxes[layer], classes, target_boxes, **kw)
        total = total + loss
    return total, metrics


# ------------------------------------------------------------------------------------------
# Metrics (numpy)


def detections(logits: np.ndarray, boxes: np.ndarray):
    """``[n, Q, C+1]`` logits, ``[n, Q, 4]`` boxes -> (score ``[n, Q]``, class ``[n, Q]``, is_object ``[n, Q]``).

    Score and class are the best real class (DETR's convention); ``is_object`` says the argmax
    over all C+1 logits is not "no object".
    """
    logits = np.asarray(logits, np.float64)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    return prob[..., :-1].max(-1), prob[..., :-1].argmax(-1), prob.argmax(-1) < logits.shape[-1] - 1


def average_precision(scores, pred_classes, pred_boxes, gt_classes, gt_boxes, *, iou=0.5, num_classes=None):
    """Per-class average precision at an IoU threshold (all-point interpolation, as PASCAL VOC 2010+).

    For each class, the predictions of that class over all images, by decreasing score, are true
    positives when they overlap a not yet claimed ground-truth item of that class in the same
    image with IoU >= ``iou``; AP is the area under the precision envelope against recall.

    Args:
        scores, pred_classes: ``[n, Q]``; pred_boxes ``[n, Q, 4]`` (cx, cy, w, h).
        gt_classes: int ``[n, M]`` (-1 pad); gt_boxes ``[n, M, 4]``.
        iou: the threshold.
        num_classes: classes 0 .. C-1 to average over (default: those in the ground truth).

    Returns:
        ``(mean AP over classes with ground truth, {class: AP})``.
    """
    scores, pred_classes = np.asarray(scores), np.asarray(pred_classes)
    gt_classes = np.asarray(gt_classes)
    ious = pairwise_iou(
        cxcywh_to_xyxy(np.asarray(pred_boxes, np.float64)), cxcywh_to_xyxy(np.asarray(gt_boxes, np.float64))
    )
    classes = range(num_classes) if num_classes is not None else np.unique(gt_classes[gt_classes >= 0])
    per_class = {}
    for c in classes:
        n_gt = int((gt_classes == c).sum())
        if n_gt == 0:
            continue
        img, q = np.nonzero(pred_classes == c)
        order = np.argsort(-scores[img, q], kind="stable")
        claimed = np.zeros(gt_classes.shape, bool)
        tp = np.zeros(len(order))
        for r, k in enumerate(order):
            i, j = img[k], q[k]
            cand = np.where((gt_classes[i] == c) & ~claimed[i], ious[i, j], -1.0)
            best = int(cand.argmax())
            if cand[best] >= iou:
                claimed[i, best] = True
                tp[r] = 1
        recall = np.concatenate([[0.0], np.cumsum(tp) / n_gt])
        precision = np.concatenate([[1.0], np.cumsum(tp) / np.arange(1, len(tp) + 1)])
        envelope = np.maximum.accumulate(precision[::-1])[::-1]
        per_class[int(c)] = float(np.sum((recall[1:] - recall[:-1]) * envelope[1:]))
    return (float(np.mean(list(per_class.values()))) if per_class else 0.0), per_class


def count_accuracy(is_object, pred_classes, gt_classes) -> dict[int, tuple[float, int]]:
    """Per true count k: the fraction of images whose predicted objects number k and whose classes
    (as a multiset) equal the ground truth's. Returns ``{k: (accuracy, images)}``."""
    is_object, pred_classes, gt_classes = map(np.asarray, (is_object, pred_classes, gt_classes))
    counts = (gt_classes >= 0).sum(-1)
    right = np.array(
        [
            sorted(pred_classes[i][is_object[i]].tolist()) == sorted(gt_classes[i][gt_classes[i] >= 0].tolist())
            for i in range(len(gt_classes))
        ]
    )
    return {int(k): (float(right[counts == k].mean()), int((counts == k).sum())) for k in np.unique(counts)}


# ------------------------------------------------------------------------------------------
# Model


class DETR(nnx.Module):
    """Encoder over image cells + decoder over learned object queries; class and box heads.

    Args:
        num_classes: C (the class head has C + 1 outputs, the last "no object").
        image_size: side of the square input images.
        backbone: ``"patch"`` (non-overlapping ``patch`` x ``patch`` pixel patches, linearly
            embedded, as ViT) or ``"cnn"`` (``cnn_layers`` stride-2 3x3 convolutions with GELU,
            ``cnn_channels`` wide; each cell of the final map is a token).
        d_model, num_heads, mlp_dim: D, N, MLP width (default 4 D).
        encoder_layers, decoder_layers: block counts.
        num_queries: Q (>= the most items per image).

    Call: ``model(images [B, H, W], *, dropout_key=None, return_weights=False, all_layers=False)``
    -> ``(logits [B, Q, C+1], boxes [B, Q, 4] in (0, 1))`` (, cross-attention weights of each
    decoder layer, ``[B, N, Q, S]``). With ``all_layers=True`` the shared final norm and heads read
    every decoder block's output: ``logits [L, B, Q, C+1]``, ``boxes [L, B, Q, 4]``, the last block
    last (for ``deep_set_loss``).
    """

    def __init__(
        self,
        *,
        num_classes: int,
        image_size: int = 64,
        backbone: str = "patch",
        patch: int = 8,
        cnn_layers: int = 3,
        cnn_channels: int = 32,
        d_model: int = 64,
        num_heads: int = 4,
        mlp_dim: int | None = None,
        encoder_layers: int = 2,
        decoder_layers: int = 2,
        num_queries: int = 8,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ):
        for name, value in (("num_classes", num_classes), ("num_queries", num_queries), ("image_size", image_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DETR: {name} must be an int >= 1, got {value!r}")
        mlp_dim = mlp_dim or 4 * d_model
        match backbone:
            case "patch":
                if image_size % patch:
                    raise ValueError(f"DETR: patch must divide image_size={image_size}, got {patch}")
                side, width = image_size // patch, patch * patch
                self.convs = nnx.List([])
            case "cnn":
                convs, width = [], 1
                for _ in range(cnn_layers):
                    convs.append(nnx.Conv(width, cnn_channels, (3, 3), strides=2, padding="SAME", rngs=rngs))
                    width = cnn_channels
                self.convs = nnx.List(convs)
                side = image_size // 2**cnn_layers
            case _:
                raise ValueError(f"DETR: backbone must be 'patch' or 'cnn', got {backbone!r}")
        self.backbone, self.patch, self.grid = backbone, patch, (side, side)
        self.encoder = Encoder(
            d_model=d_model,
            num_layers=encoder_layers,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            input_dim=width,
            posenc=positional.Sinusoidal2D(side, side),
            dropout_rate=dropout_rate,
            rngs=rngs,
        )
        self.queries = nnx.Param(jax.random.normal(rngs.params(), (num_queries, d_model)) * 0.02)
        self.blocks = nnx.List(
            [
                DecoderBlock(d_model, num_heads, mlp_dim, dropout_rate=dropout_rate, rngs=rngs)
                for _ in range(decoder_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.class_head = nnx.Linear(d_model, num_classes + 1, rngs=rngs)
        self.box_hidden = nnx.Linear(d_model, d_model, rngs=rngs)
        self.box_out = nnx.Linear(d_model, 4, rngs=rngs)
        self.num_classes, self.image_size, self.dropout_rate = num_classes, image_size, dropout_rate

    def tokens(self, images):
        """``[B, H, W]`` float -> ``[B, S, F]`` cells row-major (the order of ``sinusoidal_2d``)."""
        B, H, W = images.shape
        if self.backbone == "patch":
            P = self.patch
            x = images.reshape(B, H // P, P, W // P, P).transpose(0, 1, 3, 2, 4)  # [B, Hg, Wg, P, P]
            return x.reshape(B, (H // P) * (W // P), P * P)  # [B, S, P*P]
        x = images[..., None]  # [B, H, W, 1]
        for conv in self.convs:
            x = jax.nn.gelu(conv(x))
        return x.reshape(B, -1, x.shape[-1])  # [B, Hg, Wg, C] -> [B, S, C]

    def heads(self, x):
        """Decoder states ``[..., Q, D]`` -> (logits ``[..., Q, C+1]``, boxes ``[..., Q, 4]``)."""
        x = self.ln_f(x)
        logits = self.class_head(x)
        boxes = jax.nn.sigmoid(self.box_out(jax.nn.relu(self.box_hidden(x))))
        return logits, boxes

    def __call__(self, images, *, dropout_key=None, return_weights=False, all_layers=False):
        if images.ndim != 3 or images.shape[1:] != (self.image_size, self.image_size):
            raise ValueError(f"DETR: images must be [B, {self.image_size}, {self.image_size}], got {images.shape}")
        k_enc, k_dec = split_key(dropout_key, 2)
        memory = self.encoder(self.tokens(images), dropout_key=k_enc)  # [B, S, D]
        x = jnp.broadcast_to(self.queries[...], (images.shape[0], *self.queries.shape))  # [B, Q, D]
        keys = split_key(k_dec, len(self.blocks))
        weights, states = [], []
        for block, k in zip(self.blocks, keys, strict=True):
            # object queries see each other (no causal mask) and every image cell
            x = block(x, memory, self_mask=None, cross_mask=None, dropout_key=k, return_weights=return_weights)
            if return_weights:
                x, w = x
                weights.append(w)
            states.append(x)
        logits, boxes = self.heads(jnp.stack(states) if all_layers else x)
        return (logits, boxes, weights) if return_weights else (logits, boxes)
