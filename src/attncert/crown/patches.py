"""Compatibility patches that let ``auto_LiRPA==0.3`` (2022, written for torch < 1.13) run on
torch 2.13 / numpy 2, the fix of its unsound softmax bound, guards on two relaxations and
the backward passes whose bounds nothing reads.

:func:`apply` is called when :mod:`attncert.crown` is imported; it is idempotent (each patch
checks whether it is already in place) and touches nothing outside auto_LiRPA's view of torch
and numpy. One function per patch, in order:

1. ``numpy.lib.arraysetops`` was removed in numpy 2; auto_LiRPA imports ``isin`` from it.
2. ``torch.onnx.symbolic_helper._set_opset_version`` is gone; auto_LiRPA calls it (opset 12)
   before the ONNX graph pass that names its operators, whose attributes it reads in the opset
   12 layout (the replacement sets the exporter's global opset, as the old function did).
3. ``torch._C.Node.__getitem__`` (``node[attr]``) is gone; the graph parser reads every
   node attribute that way.
4. ``nn.Module.named_parameters`` now calls ``_named_members(..., remove_duplicate=...)``;
   ``BoundedModule`` overrides ``_named_members`` without that keyword.
5. Softmax: auto_LiRPA decomposes it as exp(x - max x) / sum exp(x - max x) and bounds the max
   by the entry that is largest at the CLEAN input (``fixed_reducemax_index``) in its linear
   bounds but by the true max in its intervals. The two disagree once another entry can become
   the largest, and the exp relaxation is then used outside the interval it was built on:
   sampled outputs can exceed CROWN's bounds then. The shift cancels exactly, so the
   decomposition here is exp(x) / sum exp(x): no ReduceMax at all.
   (The bridge of :mod:`attncert.crown.bridge` writes its softmax that way itself.)
6. Domain guards (soundness): the relaxations of 1/x and sqrt(x) are only valid where the
   input's intermediate bounds lie in the domain (lower > 0, resp. >= 0), which auto_LiRPA does
   not check (it returns NaN or a wrong line; its interval for 1/x also casts to float32). A
   bound that leaves the domain now raises :class:`DomainError`: the point is recorded as a
   failure, never certified from a meaningless bound.
7. A matrix product asks for the bounds of both its inputs, also where the second is a
   constant weight (``F.linear`` of a token matrix is ``MatMul``): each such input (the
   attention's and the MLP's inputs, the heads' output before W^O) cost a backward pass whose
   bounds nothing reads, since a product with a constant is linear and its backward step uses
   only the weight. Bounds are now asked of the weight alone there (its value); a product of
   two perturbed inputs (the attention's scores and values) still asks for both. The bounds
   are the same to the bit, CROWN's and alpha-CROWN's (``tests/test_crown_heads.py``); at the
   paper shape (128-d, depth 3, one point) a CROWN bound's peak memory fell from 11.3 to
   7.2 GB.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

_APPLIED: list[str] = []
#: torch 2.13's warning for torch.jit.script, which auto_LiRPA calls at import
JIT_DEPRECATION = r".*torch\.jit\.script. is deprecated"


def _numpy_arraysetops() -> None:
    import numpy

    if "numpy.lib.arraysetops" not in sys.modules:
        shim = types.ModuleType("numpy.lib.arraysetops")
        shim.isin = numpy.isin
        sys.modules["numpy.lib.arraysetops"] = shim


def _onnx_opset_version() -> None:
    import importlib

    # the module auto_LiRPA imports by name (``torch.onnx.symbolic_helper`` the attribute is
    # another, internal module)
    symbolic_helper = importlib.import_module("torch.onnx.symbolic_helper")
    if not hasattr(symbolic_helper, "_set_opset_version"):
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

        def set_opset_version(opset_version: int) -> None:
            # auto_LiRPA's operators read opset-12 attributes (e.g. ReduceMean's ``axes``)
            GLOBALS.export_onnx_opset_version = opset_version

        symbolic_helper._set_opset_version = set_opset_version


def _node_getitem() -> None:
    import torch

    node = torch._C.Node
    if not hasattr(node, "__getitem__"):
        def getitem(self, name: str):
            # kindOf gives the attribute's type tag ("i", "f", "s", "t", "is", ...); the getter
            # of the same name reads it
            return getattr(self, self.kindOf(name))(name)

        node.__getitem__ = getitem


def _named_members_keyword() -> None:
    from auto_LiRPA import BoundedModule

    original = BoundedModule._named_members
    if getattr(original, "_attncert_patched", False):
        return

    def named_members(self, get_members_fn, prefix="", recurse=True, remove_duplicate=True):
        # the override already yields every member once (it keeps a memo)
        return original(self, get_members_fn, prefix, recurse)

    named_members._attncert_patched = True
    BoundedModule._named_members = named_members


def _softmax_without_max() -> None:
    import torch
    from auto_LiRPA.operators import softmax

    impl = softmax.BoundSoftmaxImpl
    if getattr(impl.forward, "_attncert_patched", False):
        return

    def forward(self, x):
        e = torch.exp(x)  # softmax is shift-invariant: no max, hence no faulty ReduceMax
        return e / torch.sum(e, dim=self.axis, keepdim=True)

    forward._attncert_patched = True
    impl.forward = forward


class DomainError(ArithmeticError):
    """An intermediate bound left the domain of an operator's relaxation (patch 6)."""


def _domain_guards() -> None:
    import torch
    from auto_LiRPA.operators import nonlinear

    recip, sqrt = nonlinear.BoundReciprocal, nonlinear.BoundSqrt
    if getattr(recip.bound_relax, "_attncert_patched", False):
        return
    recip_relax, sqrt_backward, sqrt_interval = (recip.bound_relax, sqrt.bound_backward,
                                                 sqrt.interval_propagate)

    def require(ok: torch.Tensor, what: str) -> None:
        if not bool(ok.all()):
            raise DomainError(what)

    def recip_bound_relax(self, x):
        require(x.lower > 0, "1/x: the input's lower bound reaches 0")
        return recip_relax(self, x)

    def recip_interval(self, *v):
        h_l, h_u = v[0]
        require(h_l > 0, "1/x: the input's lower bound reaches 0")
        return torch.reciprocal(h_u), torch.reciprocal(h_l)  # in the input's dtype

    def sqrt_bound_backward(self, last_lA, last_uA, x):  # noqa: N803 (auto_LiRPA's names)
        require(x.lower >= 0, "sqrt: the input's lower bound is negative")
        return sqrt_backward(self, last_lA, last_uA, x)

    def sqrt_interval_propagate(self, *v):
        require(v[0][0] >= 0, "sqrt: the input's lower bound is negative")
        return sqrt_interval(self, *v)

    for cls, name, fn in ((recip, "bound_relax", recip_bound_relax),
                          (recip, "interval_propagate", recip_interval),
                          (sqrt, "bound_backward", sqrt_bound_backward),
                          (sqrt, "interval_propagate", sqrt_interval_propagate)):
        fn._attncert_patched = True
        setattr(cls, name, fn)


def _constant_weight_products() -> None:
    from auto_LiRPA.operators.linear import BoundMatMul

    if isinstance(BoundMatMul.__dict__.get("requires_input_bounds"), property):
        return

    def requires(self) -> list[int]:
        weight = self.inputs[1] if len(getattr(self, "inputs", ())) > 1 else None
        # ``perturbed`` is marked once the graph is built; unmarked counts as perturbed
        if weight is not None and not getattr(weight, "perturbed", True):
            return [1]
        return self.__dict__.get("_requires_input_bounds", [0, 1])

    def set_requires(self, value: list[int]) -> None:  # BoundMatMul.__init__ assigns it
        self.__dict__["_requires_input_bounds"] = value

    BoundMatMul.requires_input_bounds = property(requires, set_requires)


def apply() -> list[str]:
    """Apply every patch once; return their names (in order)."""
    if not _APPLIED:
        # auto_LiRPA's import calls warnings.simplefilter("once") (for the whole process) and
        # scripts one helper with torch.jit.script (deprecated in torch 2.13): its filter change
        # stays inside this block, and the deprecation (harmless, at every stage start) is
        # silenced for this import alone
        with warnings.catch_warnings():
            simplefilter = warnings.simplefilter

            def keep_jit_silenced(*args: Any, **kwargs: Any) -> None:
                simplefilter(*args, **kwargs)
                warnings.filterwarnings("ignore", message=JIT_DEPRECATION,
                                        category=DeprecationWarning)

            warnings.simplefilter = keep_jit_silenced
            try:
                keep_jit_silenced("default")
                # 1-3 must precede the first import of auto_LiRPA (it imports these at load)
                for patch in (_numpy_arraysetops, _onnx_opset_version, _node_getitem,
                              _named_members_keyword, _softmax_without_max, _domain_guards,
                              _constant_weight_products):
                    patch()
                    _APPLIED.append(patch.__name__.lstrip("_"))
            finally:
                warnings.simplefilter = simplefilter
    return list(_APPLIED)
