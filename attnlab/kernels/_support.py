"""The check every fused dot-product kernel's ``call_reason`` starts with (Pallas, splash)."""

from __future__ import annotations

import jax.numpy as jnp

from attnlab.call import Call


def dot_call_reason(kernel: str, call: Call, *, dtypes, bias_hint: str = "", mods: bool = False) -> str | None:
    """None when the bound call is a dot-product call without bias in one of ``dtypes``, else why not.

    ``mods``: the kernel also applies a score's elementwise ``tile_mod`` (``SoftCap``) to its logits.
    """
    if mods and call.score.elementwise_mod:
        pass
    elif not call.score.is_dot:
        also = " and elementwise score mods (SoftCap)" if mods else ""
        return f"{kernel}: dot-product score{also} only (got score {type(call.score).__name__})"
    if call.bias is not None:
        return f"{kernel}: no bias{bias_hint}"
    names = [jnp.dtype(d).name for d in dtypes]
    wanted = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if call.dtype not in dtypes:
        return f"{kernel}: q dtype {call.dtype.name} (needs {wanted})"
    return None
