"""Autoregressive decoding for ``attnlab.nn.EncoderDecoder``: a KV cache, greedy and beam search.

All pure functions of the model (an NNX module is a pytree, so they run under ``jax.jit``):

- ``init_cache(model, memory, memory_lengths, max_len)``: the decoder's self-attention keys/values
  for ``max_len`` steps (zeros) and the cross-attention keys/values of the memory (computed once);
- ``decode_step(model, cache, tokens) -> (logits, cache)``: one token per sequence; the new
  token's key/value is written at ``cache.index`` and its query attends to keys ``0..index``
  (``masks.causal(offset=index)`` for a query at position ``index``, given as traced padding
  ``kv_lengths = index + 1``), so each step costs O(index), not O(index²);
- ``greedy(...)`` and ``beam_search(...)``: ``lax.while_loop`` over steps, batched, stopping at
  end-of-sequence per item (and the loop when every item has stopped);
- ``greedy_recompute(...)``: the same greedy decode without a cache (the whole prefix re-run every
  step), the baseline the cached decoder is tested and timed against.

Legend: B batch, S memory length, L decoder layers, M max steps, N heads, H head dim, V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnlab import heads
from attnlab import masks as masks_lib
from attnlab.attention import attention

__all__ = ["Cache", "init_cache", "decode_step", "greedy", "greedy_recompute", "beam_search"]


class Cache(NamedTuple):
    k: jax.Array  # [L, B, M, K, H] self-attention keys of the steps so far (zeros beyond index)
    v: jax.Array  # [L, B, M, K, Hv]
    cross_k: jax.Array  # [L, B, S, K, H] cross-attention keys of the memory
    cross_v: jax.Array  # [L, B, S, K, Hv]
    memory_lengths: jax.Array  # [B]
    index: jax.Array  # int32 scalar: the position the next token takes


def _out(p, o):
    y = heads.merge_heads(o) @ p["wo"].reshape(-1, p["wo"].shape[-1])
    return y + p["bo"] if p.get("bo") is not None else y


def init_cache(model, memory: jax.Array, memory_lengths: jax.Array, max_len: int) -> Cache:
    """Empty self-attention cache for ``max_len`` steps; cross-attention K/V of ``memory [B, S, D]``."""
    if not isinstance(max_len, int) or not 1 <= max_len <= model.max_target_len:
        raise ValueError(f"init_cache: max_len must be an int in [1, {model.max_target_len}], got {max_len!r}")
    ks, vs, cks, cvs = [], [], [], []
    for block in model.blocks:
        sp, cp = block.self_attn.params(), block.cross_attn.params()
        B = memory.shape[0]
        kh, h = sp["wk"].shape[1:]
        ks.append(jnp.zeros((B, max_len, kh, h), memory.dtype))
        vs.append(jnp.zeros((B, max_len, *sp["wv"].shape[1:]), memory.dtype))
        _, ck, cv = heads.project_qkv(cp, memory[:, :0], memory)  # K, V of the memory (no queries)
        cks.append(ck)
        cvs.append(cv)
    stack = jnp.stack
    return Cache(stack(ks), stack(vs), stack(cks), stack(cvs), memory_lengths, jnp.zeros((), jnp.int32))


def decode_step(model, cache: Cache, tokens: jax.Array) -> tuple[jax.Array, Cache]:
    """``tokens [B]`` at position ``cache.index`` -> next-token logits ``[B, V]`` and the updated cache."""
    i = cache.index
    x = model.embed_tokens(tokens[:, None], i[None])  # [B, 1, D]
    B = tokens.shape[0]
    self_mask = masks_lib.padding(kv_lengths=jnp.full((B,), i + 1))  # keys 0..i: causal at offset i
    cross_mask = masks_lib.padding(kv_lengths=cache.memory_lengths)
    new_k, new_v = [], []
    for layer, block in enumerate(model.blocks):
        sp, cp = block.self_attn.params(), block.cross_attn.params()
        q, k, v = heads.project_qkv(sp, block.ln1(x))  # the new token's query, key and value
        k_all = jax.lax.dynamic_update_slice_in_dim(cache.k[layer], k, i, axis=1)
        v_all = jax.lax.dynamic_update_slice_in_dim(cache.v[layer], v, i, axis=1)
        new_k.append(k_all)
        new_v.append(v_all)
        x = x + _out(sp, attention(q, k_all, v_all, mask=self_mask))
        h = block.ln2(x)
        q, _, _ = heads.project_qkv(cp, h, h[:, :0])  # the query only: K, V of the memory are cached
        x = x + _out(cp, attention(q, cache.cross_k[layer], cache.cross_v[layer], mask=cross_mask))
        x = block.mlp(x)
    logits = model.logits(x)[:, 0]
    return logits, cache._replace(k=jnp.stack(new_k), v=jnp.stack(new_v), index=i + 1)


def _check(bos, eos, max_len, fn):
    for name, value in (("bos", bos), ("eos", eos), ("max_len", max_len)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {value!r}")
    if max_len < 1:
        raise ValueError(f"{fn}: max_len must be >= 1, got {max_len}")


def _greedy_loop(step, state, B, V, max_len, bos, eos, pad):
    """The greedy loop both decoders share: ``step(state, prev_tokens, t) -> (logits [B, V], state)``."""

    def cond(c):
        t, _, done, *_ = c
        return (t < max_len) & ~jnp.all(done)

    def body(c):
        t, prev, done, out, logit_log, st = c
        logits, st = step(st, prev, t)
        nxt = jnp.where(done, pad, jnp.argmax(logits, -1).astype(jnp.int32))
        out = out.at[:, t].set(nxt)
        logit_log = logit_log.at[:, t].set(jnp.where(done[:, None], 0.0, logits.astype(jnp.float32)))
        return t + 1, nxt, done | (nxt == eos), out, logit_log, st

    init = (
        jnp.zeros((), jnp.int32),
        jnp.full((B,), bos, jnp.int32),
        jnp.zeros((B,), bool),
        jnp.full((B, max_len), pad, jnp.int32),
        jnp.zeros((B, max_len, V), jnp.float32),
        state,
    )
    _, _, _, tokens, logits, _ = jax.lax.while_loop(cond, body, init)
    return tokens, logits


def greedy(model, memory, memory_lengths, *, max_len: int, bos: int, eos: int, pad: int = 0):
    """Greedy decoding with the KV cache.

    Returns:
        ``tokens [B, max_len]`` (the emitted tokens after bos, ``pad`` after each item's eos) and
        ``logits [B, max_len, V]`` (fp32, zeros after eos).
    """
    _check(bos, eos, max_len, "greedy")
    cache = init_cache(model, memory, memory_lengths, max_len)
    B = memory.shape[0]
    step = lambda st, prev, t: decode_step(model, st, prev)  # noqa: E731
    return _greedy_loop(step, cache, B, model.vocab_size, max_len, bos, eos, pad)


def greedy_recompute(model, memory, memory_lengths, *, max_len: int, bos: int, eos: int, pad: int = 0):
    """Greedy decoding without a cache: every step runs the decoder over the whole prefix again."""
    _check(bos, eos, max_len, "greedy_recompute")
    B = memory.shape[0]

    def step(prefix, prev, t):
        prefix = prefix.at[:, t].set(prev)  # prefix[:, :t+1] = bos, y_1 .. y_t
        logits = model.decode(prefix, memory, memory_lengths)  # causal: positions > t do not matter
        return jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False), prefix

    prefix = jnp.full((B, max_len), pad, jnp.int32)
    return _greedy_loop(step, prefix, B, model.vocab_size, max_len, bos, eos, pad)


def beam_search(
    model, memory, memory_lengths, *, beam: int, max_len: int, bos: int, eos: int, pad: int = 0, alpha: float = 1.0
):
    """Beam search with the KV cache and length normalisation.

    Each item keeps ``beam`` hypotheses; a finished hypothesis (eos emitted) keeps its score and
    extends only by ``pad`` at no cost. The best hypothesis maximises ``log p / length**alpha``
    (``alpha = 0``: raw log-probability; the length counts the eos).

    Returns:
        ``tokens [B, max_len]`` of the best hypothesis and its normalised score ``[B]``.
    """
    _check(bos, eos, max_len, "beam_search")
    if not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam_search: beam must be an int >= 1, got {beam!r}")
    B = memory.shape[0]
    rep = lambda x: jnp.repeat(x, beam, axis=0)  # noqa: E731  [B, ...] -> [B*beam, ...]
    cache = init_cache(model, rep(memory), rep(memory_lengths), max_len)
    neg = jnp.float32(-1e30)
    # only the first hypothesis is live at the start, so the first top-k picks distinct tokens
    score = jnp.tile(jnp.where(jnp.arange(beam) == 0, 0.0, neg), (B, 1))  # [B, beam]
    state = (
        jnp.zeros((), jnp.int32),
        jnp.full((B * beam,), bos, jnp.int32),  # last token
        jnp.zeros((B, beam), bool),  # done
        jnp.zeros((B, beam), jnp.int32),  # length (tokens emitted, eos included)
        score,
        jnp.full((B, beam, max_len), pad, jnp.int32),
        cache,
    )

    def cond(c):
        return (c[0] < max_len) & ~jnp.all(c[2])

    def body(c):
        t, prev, done, length, score, seqs, cache = c
        logits, cache = decode_step(model, cache, prev)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(B, beam, -1)  # [B, beam, V]
        V = logp.shape[-1]
        # a finished hypothesis may only continue with pad, at no cost
        stay = jnp.full((V,), neg).at[pad].set(0.0)
        logp = jnp.where(done[..., None], stay, logp)
        cand = (score[..., None] + logp).reshape(B, beam * V)
        new_score, idx = jax.lax.top_k(cand, beam)  # [B, beam]
        src, tok = idx // V, (idx % V).astype(jnp.int32)
        gather = lambda x: jnp.take_along_axis(x, src, axis=1)  # noqa: E731
        was_done = gather(done)
        seqs = jnp.take_along_axis(seqs, src[..., None], axis=1).at[:, :, t].set(tok)
        length = gather(length) + (~was_done).astype(jnp.int32)
        done = was_done | (tok == eos)
        flat = (src + jnp.arange(B)[:, None] * beam).reshape(-1)  # rows of the B*beam cache
        cache = cache._replace(k=cache.k[:, flat], v=cache.v[:, flat])
        return t + 1, tok.reshape(-1), done, length, new_score, seqs, cache

    _, _, done, length, score, seqs, _ = jax.lax.while_loop(cond, body, state)
    norm = score / jnp.maximum(length, 1).astype(jnp.float32) ** alpha
    best = jnp.argmax(norm, axis=1)
    pick = lambda x: jnp.take_along_axis(x, best[:, None, *([None] * (x.ndim - 2))], axis=1)[:, 0]  # noqa: E731
    return pick(seqs), pick(norm)
