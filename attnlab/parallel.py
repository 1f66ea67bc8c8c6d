"""Attention over several devices: head parallelism and ring (sequence-parallel) attention.

Everything runs on JAX's own machinery: a ``jax.sharding.Mesh`` names the device axes, arrays
are laid out with ``NamedSharding`` / ``PartitionSpec``, and ``jax.shard_map`` runs one program
per device with explicit collectives. The same call works on 1 device, on 8 CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), on a GPU/TPU slice, or on several hosts
after ``jax.distributed.initialize()`` (the mesh then spans every process's devices).

* Head parallelism (``head_axis``): q ``[..., T, N, H]`` and k/v ``[..., S, K, H]`` are split on
  their head dims (N and K divisible by the axis size; with GQA each device keeps whole groups),
  every device attends its own heads, nothing is gathered. ``multi_head_attention`` also shards
  the projections (``wq``/``wk``/``wv`` on heads, ``wo`` on its input heads) and sums the output
  projection with one ``psum`` (Megatron-LM, arXiv 1909.08053).
* Ring attention (``seq_axis``): q, k and v are split on the sequence; key/value shards travel
  around the ring (``attnlab.kernels.ring``; Liu et al., arXiv 2310.01889). Memory per device
  is O(N / D). Lengths need not divide D: the sequence is padded to D equal chunks of whole
  tiles and the padded keys are masked (padded queries are dropped). ``layout="zigzag"`` balances a causal
  ring: 2D chunks, device d holds chunks d and 2D-1-d, so every device does the same work.
* Both at once (``mesh = make_mesh("heads=4,sp=2")``): heads over one axis, the ring over the other.

Shape legend: B batch (any leading dims), T / S query / key length, N / K query / kv heads,
H / Hv head dims, D devices on an axis.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attnlab import masks as masks_lib
from attnlab import numerics, platform
from attnlab.attention import attention as _attention
from attnlab.heads import merge_heads, project_qkv
from attnlab.kernels import blockwise as bw
from attnlab.kernels import ring as ring_lib

__all__ = ["make_mesh", "parse_mesh", "attention", "multi_head_attention", "shard", "use_host_devices"]


def parse_mesh(spec: str) -> dict[str, int]:
    """``"heads=4,sp=2"`` -> ``{"heads": 4, "sp": 2}`` (axis order kept).

    Raises:
        ValueError: for a malformed spec.
    """
    axes: dict[str, int] = {}
    for part in (p.strip() for p in str(spec).split(",")):
        name, eq, size = part.partition("=")
        if not eq or not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh: expected 'axis=size[,axis=size...]' (e.g. 'sp=8', 'heads=4,sp=2'), got {spec!r}")
        if name.strip() in axes:
            raise ValueError(f"mesh: axis {name.strip()!r} given twice in {spec!r}")
        axes[name.strip()] = int(size)
    return axes


def use_host_devices(n: int) -> int:
    """Present the CPU as ``n`` host devices, so that a mesh of ``n`` can run on one machine.

    XLA:CPU runs one device's program one op at a time and small tile matmuls on one core; with
    one host device per core, head parallelism (``make_mesh("heads=2")``) keeps every core busy
    (README, "One host device per core": the window kernel ran 1.8x faster on 2 cores). Must be
    called before JAX's first computation. Does nothing when ``XLA_FLAGS`` already forces a host
    device count (``--xla_force_host_platform_device_count``), which then decides.

    Args:
        n: host devices wanted (>= 1).

    Returns:
        The number of CPU devices JAX will have (``n``, or what ``XLA_FLAGS`` forces).

    Raises:
        ValueError: for ``n < 1``, or when JAX has already started with fewer than ``n`` CPU devices.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n: expected a positive int (host devices), got {n!r}")
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if forced:
        return int(forced.group(1))
    try:
        jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError:  # JAX already started: fine if it has enough
        have = len(jax.devices("cpu"))
        if have < n:
            raise ValueError(
                f"n: JAX already started with {have} CPU device(s), fewer than {n}; call "
                "use_host_devices before JAX's first computation (or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n})"
            ) from None
        return have
    return int(n)


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A ``Mesh`` from ``"sp=8"``, ``"heads=4,sp=2"`` or ``{"sp": 8}`` over the first devices.

    Uses ``jax.devices()`` (every process's devices after ``jax.distributed.initialize``) unless
    ``devices`` is given.

    Raises:
        ValueError: when the mesh needs more devices than there are (with the CPU flag to fix it).

    Example:
        >>> dict(make_mesh("sp=1").shape)
        {'sp': 1}
    """
    axes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = jax.devices() if devices is None else list(devices)
    need = math.prod(axes.values())
    if need > len(devices):
        raise ValueError(
            f"mesh: {axes} needs {need} devices but {len(devices)} are available; on CPU call "
            f'jax.config.update("jax_num_cpu_devices", {need}) or set '
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX's first computation"
        )
    return Mesh(np.asarray(devices[:need]).reshape(tuple(axes.values())), tuple(axes))


def _axis_size(mesh: Mesh, axis, name: str) -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"{name}: {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    return mesh.shape[axis]


def _spec(nlead: int, seq_axis, head_axis) -> PartitionSpec:
    return PartitionSpec(*([None] * nlead), seq_axis, head_axis, None)  # [..., T, N, H]


def shard(x, mesh: Mesh, *, seq_axis=None, head_axis=None):
    """Places ``[..., T, N, H]`` on ``mesh`` split on T over ``seq_axis`` and on N over ``head_axis``.

    Raises:
        ValueError: when T or N is not divisible by its axis (``attention`` pads T itself; place
            such arrays replicated or pad them first).
    """
    for dim, axis, what in ((-3, seq_axis, "sequence length"), (-2, head_axis, "head count")):
        size = _axis_size(mesh, axis, "seq_axis" if dim == -3 else "head_axis")
        if x.shape[dim] % size:
            raise ValueError(f"shard: {what} {x.shape[dim]} of x {x.shape} is not divisible by axis {axis!r} ({size})")
    return jax.device_put(x, NamedSharding(mesh, _spec(x.ndim - 3, seq_axis, head_axis)))


def _check(q, k, v, mask, bias, score, mesh, seq_axis, head_axis):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or x.ndim < 3:
            raise ValueError(f"{name} must have shape [..., L, heads, H], got {getattr(x, 'shape', x)}")
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (see attnlab.parallel.make_mesh), got {type(mesh).__name__}"
        )
    if seq_axis is not None and seq_axis == head_axis:
        raise ValueError(f"seq_axis and head_axis must be different mesh axes, both are {seq_axis!r}")
    if bias is not None:
        raise ValueError("bias: attnlab.parallel does not take a bias yet (ALiBi/T5 would need per-head shards)")
    if score != "dot":
        raise ValueError(f"score: attnlab.parallel supports score='dot' only, got {score!r}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: expected [..., T, N, H], [..., S, K, H], [..., S, K, Hv]"
        )
    N, K = q.shape[-2], k.shape[-2]
    if N % K:
        raise ValueError(f"q has {N} heads, k has {K}: N must be a multiple of K")
    Dh = _axis_size(mesh, head_axis, "head_axis")
    if N % Dh or K % Dh:
        raise ValueError(
            f"head_axis {head_axis!r} has {Dh} devices: the query heads (N={N}) and kv heads (K={K}) "
            f"must both be divisible by it"
        )
    m = masks_lib.as_mask(mask, "mask")
    if m is not None and not isinstance(m, masks_lib.Mask):
        raise ValueError(f"mask: expected an attnlab mask or bool array, got {type(mask).__name__}")
    return m


def _pad_seq(x, length: int):
    """[..., L, heads, H] -> [..., length, heads, H] with zeros."""
    pad = [(0, 0)] * x.ndim
    pad[-3] = (0, length - x.shape[-3])
    return jnp.pad(x, pad) if length > x.shape[-3] else x


def _ring_static(m, q, k, v, *, mesh, seq_axis, head_axis, scale, block_sizes, layout):
    *lead, T, N, H = q.shape
    S, K = k.shape[-3], k.shape[-2]
    Dh, Ds = _axis_size(mesh, head_axis, "head_axis"), _axis_size(mesh, seq_axis, "seq_axis")
    if block_sizes is None:
        block_sizes = bw.default_block_sizes()
    if not isinstance(block_sizes, bw.BlockSizes):
        raise ValueError(f"block_sizes must be an attnlab.kernels.BlockSizes, got {block_sizes!r}")
    return ring_lib.make_static(
        None if isinstance(m, masks_lib.Full) else m,
        axis=seq_axis,
        D=Ds,
        T=T,
        S=S,
        lead=tuple(lead),
        N=N // Dh,
        K=K // Dh,
        H=H,
        scale=numerics.default_scale(H, scale),
        compute_dtype=numerics.compute_dtype(q.dtype, platform.target()),
        block_sizes=block_sizes,
        layout=layout,
    )


def _check_layout(layout):
    if layout not in ring_lib.LAYOUTS:
        raise ValueError(f"layout: expected one of {ring_lib.LAYOUTS} (how the ring assigns chunks), got {layout!r}")


def attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    seq_axis: str | None = None,
    head_axis: str | None = None,
    mask=None,
    bias=None,
    score="dot",
    scale=None,
    implementation=None,
    block_sizes=None,
    layout: str = "contiguous",
):
    """``attnlab.attention`` split over the devices of ``mesh``; equals it up to rounding.

    Args:
        q: ``[..., T, N, H]`` (any sharding; it is laid out as the axes say, usually in place).
        k: ``[..., S, K, H]``.
        v: ``[..., S, K, Hv]``.
        mesh: a ``jax.sharding.Mesh`` (``make_mesh("sp=8")``); a 1-device mesh runs the same code.
        seq_axis: mesh axis for ring attention over the sequence, or None. T and S need not be
            divisible by its size: they are padded to a multiple and the padding is masked.
        head_axis: mesh axis for head parallelism, or None; N and K must be divisible by its size.
        mask: an ``attnlab.masks`` object or bool array (replicated on every device; the ring
            evaluates it at global positions). Full, causal, window and padding masks have exact
            block layouts, so the ring skips the steps whose blocks are empty.
        bias: must be None (not supported here yet).
        score: ``"dot"`` only.
        scale: logit scale, default ``1/sqrt(H)``.
        implementation: the per-device implementation when ``seq_axis`` is None (as
            ``attnlab.attention``); the ring always uses the blockwise block step.
        block_sizes: ``attnlab.kernels.BlockSizes`` of the ring's local tiles (default: backend's);
            upper bounds: a tile may shrink so that each device's chunk is a whole number of tiles.
        layout: how the ring assigns the sequence to devices: ``"contiguous"`` (device d holds the
            d-th of D chunks) or ``"zigzag"`` (2D chunks, device d holds d and 2D-1-d: every device
            does the same causal work; ``attnlab.kernels.ring``). Inputs and output stay in
            sequence order either way (the reordering is inside, by ``ppermute``).

    Returns:
        ``[..., T, N, Hv]`` in q's dtype, sharded like q.

    Raises:
        ValueError: for a bias, a non-dot score, heads not divisible by the head axis, unknown axes.

    Example:
        >>> mesh = make_mesh("sp=1")
        >>> q = k = v = jnp.ones((10, 2, 4))
        >>> attention(q, k, v, mesh=mesh, seq_axis="sp", mask=masks_lib.causal()).shape
        (10, 2, 4)
    """
    m = _check(q, k, v, mask, bias, score, mesh, seq_axis, head_axis)
    _check_layout(layout)
    nlead = q.ndim - 3
    if seq_axis is None:  # head parallelism only: each device runs attnlab.attention on its heads

        def body(q, k, v, m):
            return _attention(q, k, v, mask=m, scale=scale, implementation=implementation)

        spec = _spec(nlead, None, head_axis)
        fn = jax.shard_map(
            body, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec()), out_specs=spec, check_vma=False
        )
        return fn(q, k, v, m)

    rs = _ring_static(
        m,
        q,
        k,
        v,
        mesh=mesh,
        seq_axis=seq_axis,
        head_axis=head_axis,
        scale=scale,
        block_sizes=block_sizes,
        layout=layout,
    )
    T = q.shape[-3]
    lead = q.shape[:-3]
    B = math.prod(lead)

    def body(q, k, v, m):  # local shards [..., Tl, N/Dh, H]
        flat = lambda x: x.reshape(B, *x.shape[-3:])  # noqa: E731  [..., L, heads, H] -> [B, L, heads, H]
        out = ring_lib.ring_attention_shard(flat(q), flat(k), flat(v), m, rs)
        return out.reshape(*lead, *out.shape[1:])

    spec = _spec(nlead, seq_axis, head_axis)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec()), out_specs=spec, check_vma=False)
    D = rs.D
    out = fn(_pad_seq(q, D * rs.Tl), _pad_seq(k, D * rs.Sl), _pad_seq(v, D * rs.Sl), None if rs_mask_is_full(m) else m)
    return out[..., :T, :, :]


def rs_mask_is_full(m) -> bool:
    return m is None or isinstance(m, masks_lib.Full)


def multi_head_attention(
    params,
    x_q,
    x_kv=None,
    *,
    mesh: Mesh,
    seq_axis: str | None = None,
    head_axis: str | None = None,
    mask=None,
    scale=None,
    implementation=None,
    block_sizes=None,
    layout: str = "contiguous",
):
    """``attnlab.multi_head_attention`` (dot score) split over ``mesh``; equals it up to rounding.

    With ``head_axis`` the projections are split too: device i holds ``wq[:, heads_i]``,
    ``wk``/``wv`` of its kv heads and ``wo[heads_i]``, computes its heads' partial output
    ``merge(O_i) @ wo_i`` and one ``psum`` over the head axis adds them (``bo`` once, after).
    With ``seq_axis`` the inputs are split on the sequence and attention runs as a ring.

    Args:
        params: from ``init_multi_head_params`` (``score="dot"``).
        x_q: ``[..., T, D]``.
        x_kv: ``[..., S, Dkv]`` or None (self-attention).
        mesh, seq_axis, head_axis, mask, scale, implementation, block_sizes, layout: as ``attention``.

    Returns:
        ``[..., T, D]``.
    """
    x_kv = x_q if x_kv is None else x_kv
    for name, x in (("x_q", x_q), ("x_kv", x_kv)):
        if not hasattr(x, "ndim") or x.ndim < 2:
            raise ValueError(f"multi_head_attention: {name} must have shape [..., T, D], got {getattr(x, 'shape', x)}")
    if "w_score" in params:
        raise ValueError(
            "multi_head_attention: params hold w_score (additive score); attnlab.parallel supports dot only"
        )
    wq, wk, wv = params["wq"], params["wk"], params["wv"]
    N, K, H, Hv = wq.shape[1], wk.shape[1], wq.shape[2], wv.shape[2]
    lead, T, S = x_q.shape[:-2], x_q.shape[-2], x_kv.shape[-2]
    # shapes of the per-head tensors, to check divisibility and build the ring's statics
    q_aval = jax.ShapeDtypeStruct((*lead, T, N, H), x_q.dtype)
    k_aval = jax.ShapeDtypeStruct((*lead, S, K, H), x_kv.dtype)
    v_aval = jax.ShapeDtypeStruct((*lead, S, K, Hv), x_kv.dtype)
    m = _check(q_aval, k_aval, v_aval, mask, None, "dot", mesh, seq_axis, head_axis)
    _check_layout(layout)
    rs = None
    if seq_axis is not None:
        rs = _ring_static(
            m,
            q_aval,
            k_aval,
            v_aval,
            mesh=mesh,
            seq_axis=seq_axis,
            head_axis=head_axis,
            scale=scale,
            block_sizes=block_sizes,
            layout=layout,
        )
    B = math.prod(lead)
    nlead = len(lead)

    def body(p, xq, xkv, m):
        q, k, v = project_qkv(p, xq, xkv)  # [..., Tl, N/Dh, H], [..., Sl, K/Dh, H], [..., Sl, K/Dh, Hv]
        if rs is None:
            o = _attention(q, k, v, mask=m, scale=scale, implementation=implementation)
        else:
            flat = lambda x: x.reshape(B, *x.shape[-3:])  # noqa: E731
            o = ring_lib.ring_attention_shard(flat(q), flat(k), flat(v), m, rs)
            o = o.reshape(*lead, *o.shape[1:])
        n, hv, d = p["wo"].shape
        y = merge_heads(o) @ p["wo"].reshape(n * hv, d)  # [..., Tl, N_i*Hv] @ [N_i*Hv, D]: this device's heads
        if head_axis is not None:
            y = jax.lax.psum(y, head_axis)  # sum over the head shards: the full output projection
        return y

    P = PartitionSpec
    pspecs = {
        "wq": P(None, head_axis, None),
        "wk": P(None, head_axis, None),
        "wv": P(None, head_axis, None),
        "wo": P(head_axis, None, None),
        "bq": P(head_axis, None),
        "bk": P(head_axis, None),
        "bv": P(head_axis, None),
    }
    p = {name: params[name] for name in pspecs if name in params}
    xspec = P(*([None] * nlead), seq_axis, None)  # [..., T, D]
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=({n: pspecs[n] for n in p}, xspec, xspec, P()),
        out_specs=xspec,
        check_vma=False,
    )
    if rs is not None:
        pad = lambda x, L: jnp.pad(x, [(0, 0)] * nlead + [(0, L - x.shape[-2]), (0, 0)])  # noqa: E731
        xq, xkv = pad(x_q, rs.D * rs.Tl), pad(x_kv, rs.D * rs.Sl)
    else:
        xq, xkv = x_q, x_kv
    y = fn(p, xq, xkv, None if rs_mask_is_full(m) else m)[..., :T, :]
    if params.get("bo") is not None:
        y = y + params["bo"]
    return y
