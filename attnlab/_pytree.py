"""``register_dataclass``: jax's, with the class in the treedef's aux data.

jax 0.10's ``jax.tree_util.register_dataclass`` makes treedefs that compare equal across classes whose
static fields hold equal values: ``tree_structure(masks.causal(offset=8)) == tree_structure(
masks.chunks(8))`` is True (their hashes differ). A jit cache that meets both in one bucket then runs one's
program for the other: a full test run once gave the blockwise kernel's causal result for a chunks mask.
Registering through ``register_pytree_with_keys`` with ``(cls, static values)`` as the aux data keeps
every class its own treedef. Same arguments as jax's; the fields' keys (``GetAttrKey``) are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

__all__ = ["register_dataclass"]


def register_dataclass(cls, data_fields: Sequence[str], meta_fields: Sequence[str]):
    """Registers the dataclass ``cls`` as a pytree: ``data_fields`` are children, ``meta_fields`` static.

    Unflattening sets the fields directly (no ``__init__`` / ``__post_init__``: children may be tracers
    or placeholders). Returns ``cls``.
    """
    data, meta = tuple(data_fields), tuple(meta_fields)
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def aux(x):
        return (cls, tuple(getattr(x, name) for name in meta))

    def flatten_with_keys(x):
        return [(key, getattr(x, name)) for key, name in zip(keys, data, strict=True)], aux(x)

    def flatten(x):
        return [getattr(x, name) for name in data], aux(x)

    def unflatten(aux_data, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux_data[1], strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls
