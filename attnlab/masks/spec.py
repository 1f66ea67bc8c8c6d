"""Masks from strings (flags, configs): one grammar for the sweep, the configs and the Encoder."""

from __future__ import annotations

import functools

import numpy as np

from attnlab.masks.base import Mask
from attnlab.masks.graph import document, graph, prefix_lm
from attnlab.masks.sparse import bigbird, chunks, dilated, global_tokens
from attnlab.masks.structural import causal, full, window, window_2d

SPEC_GRAMMAR = """\
spec    := conj ("|" conj)*          either side allows
conj    := term ("&" term)*          both sides allow
term    := full | causal[:OFFSET] | window:LEFT:RIGHT | chunks:SIZE | dilated:LEFT:RIGHT:DILATION
         | global:I[,J...] | window_2d:WIDTH:ROW[:COL] | graph:DENSITY
         | bigbird[:KEY=VALUE...]  (block_size, window_blocks, num_global, num_random, seed, seq_len)
         | document:DOCS  (DOCS documents of random lengths packed in one row; needs seq_len)
         | prefix_lm:PREFIX"""


def _spec_int(spec, what, text):
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"masks.from_spec: bad spec {spec!r}: {what} must be an int, got {text!r}") from None


def _spec_term(term: str, spec: str, seq_len, seed) -> Mask:
    name, *args = term.strip().split(":")
    ints = lambda *whats: [_spec_int(spec, w, a) for w, a in zip(whats, args, strict=False)]  # noqa: E731
    arity = {"full": (0,), "causal": (0, 1), "window": (2,), "chunks": (1,), "dilated": (3,), "global": (1,)}
    arity |= {"window_2d": (2, 3), "graph": (1,), "document": (1,), "prefix_lm": (1,)}
    if name in arity and len(args) not in arity[name]:
        raise ValueError(
            f"masks.from_spec: bad spec {spec!r}: {name!r} takes {' or '.join(map(str, arity[name]))} "
            f"':'-separated arguments, got {len(args)} in {term.strip()!r}"
        )
    match name:
        case "full":
            return full()
        case "causal":
            return causal(*ints("offset"))
        case "window":
            return window(*ints("left", "right"))
        case "chunks":
            return chunks(*ints("size"))
        case "dilated":
            return dilated(*ints("left", "right", "dilation"))
        case "global":
            return global_tokens([_spec_int(spec, "a global index", i) for i in args[0].split(",")])
        case "window_2d":
            return window_2d(*ints("width", "row_radius", "col_radius"))
        case "graph":
            if seq_len is None:
                raise ValueError(f"masks.from_spec: bad spec {spec!r}: 'graph:DENSITY' needs seq_len=")
            try:
                density = float(args[0])
            except ValueError:
                msg = f"masks.from_spec: bad spec {spec!r}: density must be a float, got {args[0]!r}"
                raise ValueError(msg) from None
            adj = np.random.default_rng(seed).random((seq_len, seq_len)) < density
            return graph(adj | np.eye(seq_len, dtype=bool))  # self-loops: no empty rows
        case "prefix_lm":
            return prefix_lm(*ints("prefix"))
        case "document":
            if seq_len is None:
                raise ValueError(f"masks.from_spec: bad spec {spec!r}: 'document:DOCS' needs seq_len=")
            (docs,) = ints("docs")
            if not 1 <= docs <= seq_len:
                msg = f"masks.from_spec: bad spec {spec!r}: DOCS must be in [1, seq_len={seq_len}], got {docs}"
                raise ValueError(msg)
            cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seq_len), docs - 1, replace=False))
            return document(np.searchsorted(cuts, np.arange(seq_len), side="right").astype(np.int32)[None])
        case "bigbird":
            kw = {"seed": seed, "seq_len": seq_len}
            keys = ("block_size", "window_blocks", "num_global", "num_random", "seed", "seq_len")
            for a in args:
                key, eq, val = a.partition("=")
                if not eq or key not in keys:
                    raise ValueError(f"masks.from_spec: bad spec {spec!r}: bigbird takes KEY=VALUE with KEY in {keys}")
                kw[key] = _spec_int(spec, key, val)
            n = kw.pop("seq_len")
            if n is None:
                raise ValueError(f"masks.from_spec: bad spec {spec!r}: 'bigbird' needs seq_len (argument or seq_len=N)")
            return bigbird(n, **kw)
    raise ValueError(f"masks.from_spec: bad spec {spec!r}: unknown mask {name!r}; expected\n{SPEC_GRAMMAR}")


def from_spec(spec: str, *, seq_len: int | None = None, seed: int = 0) -> Mask:
    """A structural mask from a string, e.g. ``"window:64:64"``, ``"causal & chunks:128"``.

    Grammar (``&`` binds tighter than ``|``; spaces are ignored)::

        spec    := conj ("|" conj)*
        conj    := term ("&" term)*
        term    := full | causal[:OFFSET] | window:LEFT:RIGHT | chunks:SIZE | dilated:LEFT:RIGHT:DILATION
                 | global:I[,J...] | window_2d:WIDTH:ROW[:COL] | graph:DENSITY | bigbird[:KEY=VALUE...]

    ``graph:DENSITY`` is a random adjacency with self-loops (numpy ``seed``) and ``bigbird`` needs
    ``seq_len`` (here or as ``seq_len=N`` in the spec); padding is data, not structure, so it has no spec.

    Raises:
        ValueError: naming the spec and what was expected.

    Example:
        >>> from_spec("window:1:0 | global:0").dense(3, 3).astype(int).tolist()
        [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"masks.from_spec: spec must be a non-empty string, got {spec!r}")
    either = []
    for conj in spec.split("|"):
        try:
            both = [_spec_term(t, spec, seq_len, seed) for t in conj.split("&")]
        except ValueError as e:  # a constructor's message (e.g. "left must be >= 0") gets the spec
            if str(e).startswith("masks.from_spec"):
                raise
            raise ValueError(f"masks.from_spec: bad spec {spec!r}: {e}") from None
        either.append(functools.reduce(lambda a, b: a & b, both))
    return functools.reduce(lambda a, b: a | b, either)
