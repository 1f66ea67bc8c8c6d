"""n -> m: speech recognition with truncated self-attention, cross-attention and KV-cache decoding.

The course note's third task shape (seq2seq: the output length is learned) and its first derived
technique, truncated self-attention for long speech. An ``nn.EncoderDecoder`` reads 80-bin log-mel
frames of spoken numbers (``attnlab.data.speech``: espeak-ng, offline) and writes the characters;
the same model is trained with the encoder's self-attention full and truncated to ±w frames.

Commands:

    make speech            # data (espeak-ng), every window, then the report
    python -m experiments.speech --config experiments/configs/speech.py:default --out results/speech
    python -m experiments.speech --report results/speech    # tables + figures from the JSONL alone

Writes into ``--out``: ``results.jsonl`` (one line per window x seed: CER/WER greedy and beam on
held-out numbers and on the held-out voice, train time, parameters), ``scaling.jsonl`` (encoder
train-step time and compiled memory vs utterance length, full vs windowed), ``decoding.jsonl``
(cached vs recomputed greedy decoding at a fixed number of tokens), ``maps-<window>.npz``
(attention maps of one test utterance), and from ``--report``: ``summary.md``,
``cer_vs_window.png``, ``scaling.png``, ``alignment.png`` (cross-attention: decoder step vs encoder
frame) and ``encoder_maps.png`` (encoder self-attention, full vs truncated).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jiwer
import ml_collections
import numpy as np
import optax
from flax import nnx

from attnlab import decoding, inspect, masks
from attnlab import train as train_lib
from attnlab.data import speech
from attnlab.nn import EncoderDecoder, subsampled_lengths
from experiments import common
from experiments.speech_report import monotonicity, report, window_label, window_order  # noqa: F401


def _window(name) -> int | None:
    return None if str(name) == "full" else int(name)


def build_model(cfg, window, seed: int, *, max_source_len: int = 4096, max_target_len=None) -> EncoderDecoder:
    m = cfg.model
    w = _window(window)
    return EncoderDecoder(
        input_dim=80,
        vocab_size=speech.VOCAB_SIZE,
        d_model=m.d_model,
        num_heads=m.num_heads,
        encoder_layers=m.encoder_layers,
        decoder_layers=m.decoder_layers,
        subsample=m.subsample,
        encoder_mask=None if w is None else masks.window(w, w),
        max_source_len=max_source_len,
        max_target_len=max_target_len or cfg.model.max_target_len,
        dropout_rate=m.dropout,
        ctc_head=cfg.train.ctc_weight > 0,
        rngs=nnx.Rngs(seed),
    )


def _teacher_inputs(targets):
    """Decoder inputs: BOS then the targets shifted right (the last target, EOS or PAD, dropped)."""
    return jnp.concatenate([jnp.full((targets.shape[0], 1), speech.BOS, targets.dtype), targets[:, :-1]], axis=1)


def loss_fn(model, batch, key, *, smoothing: float, ctc_weight: float = 0.0):
    """Label-smoothed cross-entropy of teacher forcing; with ``ctc_weight`` > 0, mixed with the
    encoder's CTC loss (blank = PAD), ``(1 - ctc_weight) * attention + ctc_weight * ctc``."""
    k_enc, k_dec = jax.random.split(key) if key is not None else (None, None)
    memory, mem_len = model.encode(batch["features"], batch["lengths"], dropout_key=k_enc)
    logits = model.decode(
        _teacher_inputs(batch["targets"]), memory, mem_len, batch["target_lengths"], dropout_key=k_dec
    ).astype(jnp.float32)
    labels = optax.smooth_labels(jax.nn.one_hot(batch["targets"], logits.shape[-1]), smoothing)
    valid = jnp.arange(logits.shape[1])[None, :] < batch["target_lengths"][:, None]
    loss = jnp.sum(optax.softmax_cross_entropy(logits, labels) * valid) / jnp.maximum(valid.sum(), 1)
    acc = jnp.sum((logits.argmax(-1) == batch["targets"]) * valid) / jnp.maximum(valid.sum(), 1)
    metrics = {"char_accuracy": acc}
    if ctc_weight:
        ctc = ctc_loss(model, memory, mem_len, batch["targets"], batch["target_lengths"])
        metrics |= {"attention_loss": loss, "ctc_loss": ctc}
        loss = (1.0 - ctc_weight) * loss + ctc_weight * ctc
    return loss, metrics


def ctc_loss(model, memory, mem_len, targets, target_lengths):
    """Mean CTC loss per character of the encoder's ``ctc_logits`` (blank = PAD; EOS not a label)."""
    logits = model.ctc_logits(memory).astype(jnp.float32)
    frame_pad = (jnp.arange(logits.shape[1])[None, :] >= mem_len[:, None]).astype(jnp.float32)
    n = target_lengths - 1  # the characters, EOS dropped
    label_pad = (jnp.arange(targets.shape[1])[None, :] >= n[:, None]).astype(jnp.float32)
    per_seq = optax.ctc_loss(logits, frame_pad, targets, label_pad, blank_id=speech.PAD)
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(n), 1)


def _padded(n: int, pad_to: int) -> int:
    return -(-n // pad_to) * pad_to


def _batch_fn(split: speech.Split, batch_size: int, seed: int, pad_to: int, target_pad: int = 16):
    """``step -> batch`` of utterances of similar length (the usual ASR bucketing).

    Each epoch (``rng([seed, epoch])``) sorts the utterances by length plus a random jitter of up
    to ``pad_to`` frames, cuts the order into batches and shuffles the batches, so every utterance
    is seen once per epoch (the last ``len % batch_size`` of an epoch's order are skipped) and a
    batch pads little: frames to a multiple of ``pad_to``, characters to a multiple of
    ``target_pad`` (a few shapes: a few compiles).
    """
    n = len(split)
    if batch_size > n:
        raise ValueError(f"batch_size ({batch_size}) must be <= the {n} training utterances")
    per_epoch = n // batch_size
    cache = {}

    def epoch_batches(epoch):
        if epoch not in cache:
            rng = np.random.default_rng([seed, epoch])
            order = np.argsort(split.lengths + rng.uniform(0, pad_to, n), kind="stable")
            chunks = order[: per_epoch * batch_size].reshape(per_epoch, batch_size)
            cache.clear()
            cache[epoch] = chunks[rng.permutation(per_epoch)]
        return cache[epoch]

    def batch_fn(step):
        epoch, i = divmod(step - 1, per_epoch)
        idx = np.sort(epoch_batches(epoch)[i])
        T = _padded(int(split.lengths[idx].max()), pad_to)
        U = min(_padded(int(split.target_lengths[idx].max()), target_pad), split.targets.shape[1])
        f = split.features[idx, :T]
        return {
            "features": np.pad(f, ((0, 0), (0, T - f.shape[1]), (0, 0))),  # T may pass the longest utterance
            "lengths": split.lengths[idx],
            "targets": split.targets[idx, :U],
            "target_lengths": split.target_lengths[idx],
        }

    return batch_fn


@nnx.jit(static_argnames=("beam", "max_len", "alpha"))
def _transcribe(model, features, lengths, *, beam: int, max_len: int, alpha: float):
    memory, mem_len = model.encode(features, lengths)
    kw = dict(max_len=max_len, bos=speech.BOS, eos=speech.EOS, pad=speech.PAD)
    if beam == 1:
        return decoding.greedy(model, memory, mem_len, **kw)[0]
    return decoding.beam_search(model, memory, mem_len, beam=beam, alpha=alpha, **kw)[0]


def error_rates(model, split: speech.Split, ev, *, beam: int) -> dict:
    """Character and word error rates (jiwer) of greedy (beam=1) or beam decoding on a split."""
    T = _padded(int(split.lengths.max()), 64)
    apply = lambda f, n: _transcribe(model, f, n, beam=beam, max_len=ev.max_len, alpha=ev.alpha)  # noqa: E731
    ids = common.predict(apply, [split.features[:, :T], split.lengths], ev.batch_size)
    hyps = [speech.decode_ids(row) for row in ids]
    return {
        "cer": float(jiwer.cer(list(split.texts), hyps)),
        "wer": float(jiwer.wer(list(split.texts), hyps)),
        "example": [split.texts[0], hyps[0]],
    }


@nnx.jit
def _capture_weights(model, features, lengths, targets, target_lengths):
    """Every attention layer's weights under teacher forcing: one compile instead of op-by-op dispatch."""
    return inspect.capture(model, features, lengths, _teacher_inputs(targets), target_lengths, record=("weights",))


def _maps(model, split: speech.Split) -> dict:
    """Encoder self-attention (last layer, head-averaged) and decoder cross-attention of utterance 0."""
    f, n, tgt, tl = (jnp.asarray(a[:1]) for a in (split.features, split.lengths, split.targets, split.target_lengths))
    cap = _capture_weights(model, f, n, tgt, tl)
    encoder, cross = cap.select("encoder.*")[-1].weights, cap.select("*cross_attn")[-1].weights
    s, u = int(subsampled_lengths(n, model.subsample)[0]), int(tl[0])
    return {
        "encoder": np.asarray(encoder[0].mean(0))[:s, :s],
        "cross": np.asarray(cross[0].mean(0))[:u, :s],
        "text": np.array(split.texts[0]),
    }


def alignments(model, split: speech.Split, batch_size: int) -> np.ndarray:
    """``monotonicity`` of every utterance's cross-attention (last decoder block, head mean; teacher forcing)."""
    T = _padded(int(split.lengths.max()), 64)
    values = []
    for i in range(0, len(split.lengths), batch_size):
        sl = slice(i, i + batch_size)
        f, n = jnp.asarray(split.features[sl, :T]), jnp.asarray(split.lengths[sl])
        tgt, tl = jnp.asarray(split.targets[sl]), jnp.asarray(split.target_lengths[sl])
        cap = _capture_weights(model, f, n, tgt, tl)
        cross = np.asarray(cap.select("*cross_attn")[-1].weights).mean(1)  # [B, U, S]
        s, u = np.asarray(subsampled_lengths(n, model.subsample)), np.asarray(tl)
        values += [monotonicity(cross[b, : u[b], : s[b]]) for b in range(len(u))]
    return np.asarray(values)


def run_one(cfg, data, window, seed: int, out: Path, *, verbose=True) -> dict:
    t, ev = cfg.train, cfg.eval
    model = build_model(cfg, window, seed)
    tx = train_lib.adamw_cosine(t.learning_rate, t.warmup_steps, t.num_steps, t.weight_decay)
    lf = lambda m, b, k: loss_fn(m, b, k, smoothing=t.label_smoothing, ctc_weight=t.ctc_weight)  # noqa: E731
    model, records = train_lib.train(
        model,
        tx,
        lf,
        _batch_fn(data["train"], t.batch_size, seed, t.pad_to, t.target_pad),
        num_steps=t.num_steps,
        seed=seed,
        workdir=out / "runs" / f"window-{window}" / f"seed{seed}",
        log_every=t.log_every,
        verbose=verbose,
    )
    final = [r for r in records if r["split"] == "train"][-1]
    rec = {
        "variant": cfg.variant,
        "params": train_lib.num_params(model),
        "train_time_s": round(final["time_s"], 1),
        "step_s": round(final["time_s"] / t.num_steps, 4),
        "final_train_loss": final["loss"],
        **common.env(),
    }
    for split in ("test", "new_voice"):
        for beam in sorted({1, ev.beam}):
            r = error_rates(model, data[split], ev, beam=beam)
            name = "greedy" if beam == 1 else f"beam{beam}"
            rec |= {
                f"{split}_{name}_cer": r["cer"],
                f"{split}_{name}_wer": r["wer"],
                f"{split}_{name}_example": r["example"],
            }
    mono = alignments(model, data["test"], ev.batch_size)
    rec |= {
        "test_alignment_mean": float(mono.mean()),
        "test_alignment_sd": float(mono.std()),
        "test_alignment_min": float(mono.min()),
        "test_alignment_utterances": len(mono),
    }
    if seed == common.ints(cfg.seeds)[0]:  # the figures' maps: the first seed's model
        np.savez(out / f"maps-{window}.npz", **_maps(model, data["test"]))
    return rec


def measure_scaling(cfg, out: Path, *, verbose=True) -> list[dict]:
    """Encoder-only train step (fwd+bwd of a summed output) time and compiled memory vs frames."""

    def cell(c):
        model = build_model(cfg, c["window"], 0, max_source_len=c["frames"])
        x = jax.random.normal(jax.random.key(0), (1, c["frames"], 80))
        n = jnp.array([c["frames"]])

        def lf(m, b, k):
            return jnp.mean(m.encode(b["x"], b["n"])[0] ** 2), {}

        r = common.measure_train_step(model, optax.sgd(1e-3), lf, {"x": x, "n": n}, repeats=cfg.scaling.repeats)
        s = -(-c["frames"] // 2**cfg.model.subsample)
        return {**r, "encoder_frames": s, "step_s_per_frame": r["step_s"] / s, **common.env()}

    cells = [
        {"frames": f, "window": w} for w in common.names(cfg.scaling.windows) for f in common.ints(cfg.scaling.frames)
    ]
    return common.run_grid(out / "scaling.jsonl", cells, cell, verbose=verbose, name="speech scaling")


def measure_decoding(cfg, out: Path, *, verbose=True) -> list[dict]:
    """Cached vs recomputed greedy decoding of ``tokens`` steps (eos never emitted: every step runs)."""
    d = cfg.decoding

    def cell(c):
        model = build_model(cfg, "full", 0, max_target_len=d.tokens)
        memory = jax.random.normal(jax.random.key(1), (d.batch, 50, cfg.model.d_model))
        mem_len = jnp.full((d.batch,), 50)
        fn = decoding.greedy if c["method"] == "cached" else decoding.greedy_recompute
        run = nnx.jit(lambda m, x, n: fn(m, x, n, max_len=d.tokens, bos=speech.BOS, eos=speech.VOCAB_SIZE))
        jax.block_until_ready(run(model, memory, mem_len))  # compile
        times = []
        for _ in range(d.repeats):
            t0 = time.perf_counter()
            tokens, logits = jax.block_until_ready(run(model, memory, mem_len))
            times.append(time.perf_counter() - t0)
        np.save(out / f"decoding-{c['method']}.npy", np.asarray(tokens))
        return {"tokens": d.tokens, "batch": d.batch, "seconds": float(np.median(times)), **common.env()}

    out.mkdir(parents=True, exist_ok=True)
    recs = common.run_grid(
        out / "decoding.jsonl",
        [{"method": "cached"}, {"method": "recompute"}],
        cell,
        verbose=verbose,
        name="speech decoding",
    )
    return recs


def run(cfg: ml_collections.ConfigDict, out: Path, *, verbose: bool = True) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.to_json_best_effort(indent=2))
    measure_decoding(cfg, out, verbose=verbose)  # the cheap measurements first
    measure_scaling(cfg, out, verbose=verbose)
    opts = cfg.data.to_dict()
    normalise = opts.pop("cmvn", False)
    data = speech.load(**opts, progress=verbose)
    if normalise:  # per-utterance CMVN of the log-mel frames
        data = {k: dataclasses.replace(v, features=speech.cmvn(v.features, v.lengths)) for k, v in data.items()}
    cells = [{"window": str(w), "seed": s} for w in common.names(cfg.windows) for s in common.ints(cfg.seeds)]
    return common.run_grid(
        out / "results.jsonl",
        cells,
        lambda c: run_one(cfg, data, c["window"], c["seed"], out, verbose=verbose),
        verbose=verbose,
        name="speech",
    )


if __name__ == "__main__":
    common.launch(run, report, config="experiments/configs/speech.py:default", out="results/speech")
