"""The implementation interface: one object per implementation, one shared signature.

An implementation is an object with

* ``name``: the ``implementation=`` string;
* ``features``: what ``run`` can do beyond plain attention (``"dropout"``, ``"lse"``); a call that
  ``needs`` one goes only to implementations that have it;
* ``supports(call, backend) -> None | reason``: shapes and static structure only (a ``Call`` of
  ``jax.ShapeDtypeStruct``s works, and ``backend`` need not be this process's);
* ``pays_off(call, backend) -> None | reason``: consulted by ``implementation=None`` only;
* ``run(call)``: the result, ``[..., T, N, Hv]`` or ``(out, lse)`` when ``call.return_lse``.

``attnlab.dispatch`` tries them in its per-backend ``ORDER``; nothing else lists them.
"""

from __future__ import annotations

import importlib

import jax

from attnlab.call import Call

__all__ = ["Implementation", "LazyKernel", "LazyImplementation"]


class Implementation:
    """Base class: supports everything, always pays off, features none; subclasses override."""

    name: str = ""
    features: frozenset[str] = frozenset()

    def supports(self, call: Call, backend: str) -> str | None:
        return None

    def pays_off(self, call: Call, backend: str) -> str | None:
        return None

    def run(self, call: Call):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attnlab implementation {self.name!r}>"


class LazyKernel:
    """A kernel module imported on first use; when it cannot be imported, ``why`` says so.

    (A jax without a Pallas backend fails the import of that kernel: its implementation then
    answers ``supports`` with the reason, and dispatch moves on.)
    """

    def __init__(self, path: str):
        self.path = path
        self._state: tuple | None = None

    def load(self):
        """The module, or None (see ``why``)."""
        if self._state is None:
            try:
                self._state = (importlib.import_module(self.path), None)
            except ImportError as e:
                missing = e.name is not None and self.path.startswith(e.name)
                self._state = (None, f"{self.path} not available" + ("" if missing else f" ({e})"))
        return self._state[0]

    @property
    def why(self) -> str | None:
        self.load()
        return self._state[1]


class LazyImplementation(Implementation):
    """An implementation whose kernel module is imported on first ``run`` (the Pallas kernels).

    ``supports`` answers without importing heavy code where it can: when the module cannot be imported
    it gives that as the reason, else ``check(call, backend)``, which a subclass overrides with its
    own rules (attnlab's own kernels keep their whole protocol in their ``attnlab/impls/<name>.py``).
    By default ``check`` asks the module's ``call_reason(call, backend)`` when it has one (a kernel
    registered from outside attnlab), and ``pays_off`` its ``pays_off``; ``run`` calls ``attend(call)``.
    """

    def __init__(self, name: str, module: str, features: frozenset[str] = frozenset()):
        self.name, self.features, self.kernel = name, features, LazyKernel(module)

    def supports(self, call, backend):
        return self.kernel.why if self.kernel.load() is None else self.check(call, backend)

    def check(self, call, backend):
        rule = getattr(self.kernel.load(), "call_reason", None)
        return None if rule is None else rule(call, backend)

    def pays_off(self, call, backend):
        rule = getattr(self.kernel.load(), "pays_off", None)
        return None if rule is None else rule(call, backend)

    def run(self, call):
        mod = self.kernel.load()
        if mod is None:
            raise ValueError(f"implementation={self.name!r}: {self.kernel.why}")
        return mod.attend(call)


def static_scale_reason(name: str, call: Call) -> str | None:
    """Why a kernel that folds the score's scale into its program (a static float) cannot take the call:
    the scale is traced (a jit argument), or None."""
    if isinstance(getattr(call.score, "scale", None), jax.core.Tracer):
        return f"{name}: the scale is folded into the kernel as a static float; got a traced one (pass a Python float)"
    return None
