"""The check every fused dot-product kernel's ``call_reason`` starts with (Pallas, splash)."""

from __future__ import annotations

import jax.numpy as jnp

from attnlab import scores as scores_lib
from attnlab.call import Call


def dot_call_reason(kernel: str, call: Call, *, dtypes, bias_hint: str = "", mods: bool = False) -> str | None:
    """None when the bound call is a dot-product call without bias in one of ``dtypes``, else why not.

    ``mods``: the kernel also applies a score's ``tile_mod`` to one head's logits at a time
    (``score.per_head_mod``: ``SoftCap``, and ``ScoreMod`` with ``head_axes``), and takes a score's
    one-head pair form (``score.head_pair_form``: ``Additive``).
    """
    score = call.score
    if mods and ((score.has_mod and score.per_head_mod) or score.head_pair_form):
        pass
    elif mods and isinstance(score, scores_lib.ScoreMod):
        return (
            f"{kernel}: a ScoreMod needs head_axes (one axis or None per array) for this kernel, which works on "
            f"one head at a time and must slice the arrays per head"
        )
    elif not score.is_dot:
        also = ", SoftCap, ScoreMod (with head_axes) and Additive" if mods else ""
        return f"{kernel}: dot-product score{also} only (got score {type(score).__name__})"
    if call.bias is not None:
        return f"{kernel}: no bias{bias_hint}"
    names = [jnp.dtype(d).name for d in dtypes]
    wanted = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if call.dtype not in dtypes:
        return f"{kernel}: q dtype {call.dtype.name} (needs {wanted})"
    return None
