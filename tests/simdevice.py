"""A simulated accelerator for CPU-only test machines: device mismatches fail as on a GPU.

On a machine without a GPU every tensor and every generator lives on the CPU, so code that
draws with a CPU generator for GPU tensors, or mixes host and device tensors, passes every
CPU test and raises only on the GPU. This module gives the tests a second device type,
``simdev``, registered through PyTorch's Python backend hooks (the PrivateUse1 key):

- ``SimTensor`` is a wrapper tensor whose ``.device`` is ``simdev:0`` and whose values live
  in a CPU tensor inside it; every operator runs on that CPU tensor, so results are the CPU
  results bit for bit.
- ``simulated_device()`` is a context manager that enters a dispatch mode and replaces
  ``torch.Generator`` with a subclass that remembers the device it was asked for. While it
  is active, these raise ``DeviceError`` (the failures CUDA raises, or the host round trips
  the project forbids):
    * a random draw whose generator lives on another device than its output (CUDA: "Expected
      a 'cuda' device type for generator");
    * an operator that mixes simdev tensors with host tensors of one or more dimensions
      (CUDA: "Expected all tensors to be on the same device"), apart from the mixes CUDA
      accepts (host index tensors into a device tensor, copies), and device indices into a
      host tensor (CUDA: "indices should be either on cpu or on the same device");
    * a tensor drawn on the host with an explicit (seeded) generator, or sliced, cast or
      reshaped from one, and then copied to the device (a host draw and a transfer where a
      draw on the device costs neither).
  It also counts host synchronisations (``.item()``, ``float()``, ``bool()``, copies to the
  host, boolean-mask indexing and other operators whose output size depends on values),
  copies from the host to the device, and the linear-algebra solvers whose CUDA kernels read
  their status on the host (:data:`HOST_STATUS_SOLVERS`), so a test can bound them: none of
  the three can be captured in a CUDA graph.

Usage::

    with simulated_device() as sim:
        model = model.to(sim.device)
        x = x.to(sim.device)
        run_the_code(model, x)
    sim.host_syncs  # number of device-to-host synchronisations seen
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "simdev"


def _register() -> None:
    from torch.utils.backend_registration import (
        _DummyBackendModule,
        _DummyPrivateUse1Hook,
        _setup_privateuseone_for_python_backend,
    )

    # reported unavailable: code that asks torch for an accelerator (torch.accelerator, a
    # pinned DataLoader) keeps seeing a CPU-only machine in the rest of the test session
    class Hooks(_DummyPrivateUse1Hook):
        def is_available(self) -> bool:
            return False

    class Module(_DummyBackendModule):
        def is_available(self) -> bool:
            return False

    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        _setup_privateuseone_for_python_backend(NAME, backend_module=Module(), hook=Hooks())
    if torch._C._get_privateuse1_backend_name() != NAME:
        raise RuntimeError("the PrivateUse1 backend is already taken by another name")


_register()
DEVICE = torch.device(NAME, 0)
_CPU = torch.device("cpu")

# CUDA kernels that accept host tensors next to device tensors
_MIXED_OK = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
             "aten::copy_", "aten::_to_copy", "aten::lift_fresh", "aten::set_"}


#: solvers whose CUDA kernels (cuSOLVER, MAGMA) copy their convergence or error status to the
#: host: a CUDA-graph capture stops there ("Cannot copy between CPU and CUDA tensors during
#: CUDA graph capture"; an OLSA text model's spectrally normalised head, H200, 2026-11-28)
HOST_STATUS_SOLVERS = frozenset({
    "aten::_linalg_svd", "aten::_linalg_eigh", "aten::linalg_eig",
    # the factorisations behind linalg.inv, solve, cholesky and lu_factor, which read their
    # status on the host unless called as the _ex forms without checks (counted either way)
    "aten::linalg_inv_ex", "aten::_linalg_solve_ex", "aten::linalg_cholesky_ex",
    "aten::linalg_lu_factor_ex"})


class DeviceError(RuntimeError):
    """A device mismatch or host round trip that a GPU run would hit."""


class SimTensor(torch.Tensor):
    """A tensor that reports device simdev:0 and computes on the CPU tensor it wraps."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=DEVICE, requires_grad=False)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"SimTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if not _ACTIVE:
            raise DeviceError(f"{func} on a simdev tensor outside simulated_device()")
        return _ACTIVE[-1].run(func, args, kwargs or {})


class _SimGenerator(torch.Generator):
    """A real CPU generator that remembers the device it was created for."""

    def __new__(cls, device: str | torch.device | None = None):
        dev = torch.device("cpu" if device is None else device)
        if dev.type == NAME:
            dev = DEVICE
        gen = super().__new__(cls, "cpu" if dev.type == NAME else dev)
        gen._sim_device = dev
        return gen

    def __init__(self, device=None):
        pass

    @property
    def device(self) -> torch.device:
        return self._sim_device


def _is_sim(device) -> bool:
    return device is not None and torch.device(device).type == NAME


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def _device_of(t) -> torch.device:
    return DEVICE if isinstance(t, SimTensor) else t.device


def _gen_device(g) -> torch.device:
    return getattr(g, "_sim_device", None) or g.device


@dataclass
class SimRecord:
    device: torch.device = DEVICE
    host_syncs: int = 0
    host_to_device: int = 0
    solvers: list[str] = field(default_factory=list)
    draws_on_device: int = 0
    errors: list[str] = field(default_factory=list)


class _GeneratorCheck(TorchFunctionMode):
    """Every call that takes a generator: the generator's device is the result's device.

    Checked at the Python level, where the generator object still carries the device it was
    created for (the dispatcher sees a plain CPU generator).
    """

    def __init__(self, fail, record: SimRecord):
        super().__init__()
        self.fail, self.record = fail, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and isinstance(args[0], SimTensor):
            self.record.host_syncs += 1
            return args[0].elem.tolist()
        if func in _FROM_DATA and _is_sim(kwargs.get("device")):
            # these build the host tensor below the dispatcher's Python key: build it on the
            # host, then copy it over (as CUDA does)
            data = args[0] if args else kwargs.pop("data")
            if isinstance(data, SimTensor):
                return func(data, *args[1:], **kwargs)
            kwargs = {**kwargs, "device": _CPU}
            return func(data, *args[1:], **kwargs).to(DEVICE)
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        gens = [g for g in flat if isinstance(g, torch.Generator)]
        if gens:
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            res = out if isinstance(out, torch.Tensor) else (tensors[0] if tensors else None)
            if res is not None:
                out_dev, gen_dev = _device_of(res), _gen_device(gens[0])
                if out_dev.type != gen_dev.type:
                    self.fail(f"{getattr(func, '__name__', func)}: expected a '{out_dev.type}' "
                              f"device type for generator but found '{gen_dev.type}'")
                if out_dev.type == NAME:
                    self.record.draws_on_device += 1
        return out


class _Mode(TorchDispatchMode):
    """Creations on simdev (factories, copies to it) and host operators; operators on simdev
    tensors are left to ``SimTensor.__torch_dispatch__`` (both call :meth:`run`)."""

    def __init__(self, record: SimRecord):
        super().__init__()
        self.record = record
        self._host_drawn: dict[int, weakref.ref] = {}

    # -- host-drawn tensors (and what is sliced, cast or reshaped from them) --
    def _mark(self, t: torch.Tensor) -> None:
        key = id(t)
        self._host_drawn[key] = weakref.ref(t, lambda _, k=key: self._host_drawn.pop(k, None))

    def _is_host_drawn(self, t) -> bool:
        ref = self._host_drawn.get(id(t))
        return ref is not None and ref() is t

    def _fail(self, msg: str):
        self.record.errors.append(msg)
        raise DeviceError(msg)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if not (isinstance(dev, torch.device) and dev.type == NAME):
            if any(isinstance(t, SimTensor) for t in tree_flatten((args, kwargs))[0]):
                return NotImplemented  # SimTensor.__torch_dispatch__ runs it
            out = func(*args, **kwargs)
            first = args[0] if args else None
            if isinstance(out, torch.Tensor) and (kwargs.get("generator") is not None or (
                    isinstance(first, torch.Tensor) and self._is_host_drawn(first))):
                self._mark(out)
            return out
        return self.run(func, args, kwargs)

    def run(self, func, args, kwargs):
        kwargs = dict(kwargs)
        name = func._schema.name
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_sim = any(isinstance(t, SimTensor) for t in tensors)
        to_sim = isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == NAME
        if to_sim:
            kwargs["device"] = _CPU
            if name == "aten::_efficientzerotensor":  # forward-mode AD's zero tangents
                return SimTensor(torch.zeros(*args, **kwargs))
        if on_sim and name not in _MIXED_OK:
            for t in tensors:
                if not isinstance(t, SimTensor) and t.dim() > 0 and t.device.type != "meta":
                    self._fail(f"{name}: expected all tensors on one device, found {NAME}:0 "
                               f"and a host tensor of shape {tuple(t.shape)}")
        if (on_sim and name.startswith(("aten::index", "aten::_index_put"))
                and isinstance(args[0], torch.Tensor) and not isinstance(args[0], SimTensor)
                and args[0].dim() > 0):  # CUDA: "indices should be either on cpu or on the
            self._fail(f"{name}: a host tensor of shape {tuple(args[0].shape)} indexed by "
                       f"{NAME} indices")  # same device as the indexed tensor"
        if name == "aten::copy_" and isinstance(args[0], SimTensor):
            src = args[1]
            if not isinstance(src, SimTensor) and self._is_host_drawn(src):
                self._fail("a tensor drawn at random on the host is copied to the device")
        if name == "aten::_to_copy" and to_sim and tensors and self._is_host_drawn(tensors[0]):
            self._fail("a tensor drawn at random on the host is copied to the device")
        scalar = name == "aten::_local_scalar_dense"
        to_host = (name == "aten::_to_copy" and on_sim and not to_sim
                   and isinstance(kwargs.get("device"), torch.device)
                   and kwargs["device"].type == "cpu")
        if scalar or to_host or (on_sim and _data_dependent_shape(name, args)):
            self.record.host_syncs += 1
        if _from_host(name, args, tensors, to_sim):
            self.record.host_to_device += 1
        if on_sim and name in HOST_STATUS_SOLVERS:
            self.record.solvers.append(name)
        un = tree_map(lambda t: t.elem if isinstance(t, SimTensor) else t, (args, kwargs))
        with torch._C._DisableFuncTorch():  # the CPU kernel itself, below torch.func's layers
            out = func(*un[0], **un[1])
        # the result lives on simdev unless it is a scalar or a copy to the host
        if (to_sim or on_sim) and not (scalar or to_host):
            return tree_map(lambda t: SimTensor(t) if isinstance(t, torch.Tensor) else t, out)
        return out


def _from_host(name: str, args, tensors, to_sim: bool) -> bool:
    """A copy of host data to the device: ``x.to(device)`` of a host tensor (scalars
    included: CUDA copies them too), or ``device_tensor.copy_(host_tensor)``."""
    if name == "aten::_to_copy":
        return to_sim and bool(tensors) and not isinstance(tensors[0], SimTensor)
    return (name == "aten::copy_" and isinstance(args[0], SimTensor)
            and isinstance(args[1], torch.Tensor) and not isinstance(args[1], SimTensor))


_ACTIVE: list[_Mode] = []
_SHAPE_FROM_DATA = {"aten::nonzero", "aten::masked_select", "aten::unique_dim",
                    "aten::_unique2", "aten::repeat_interleave"}


def _data_dependent_shape(name: str, args) -> bool:
    """An operator whose output size depends on device values waits for them (CUDA syncs):
    nonzero and friends, and indexing with a boolean mask (``x[mask]``, ``x[mask] = v``)."""
    if name in _SHAPE_FROM_DATA:
        return True
    return (name.startswith(("aten::index", "aten::_index_put")) and len(args) > 1
            and isinstance(args[1], list | tuple)
            and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1]))


@contextlib.contextmanager
def simulated_device():
    """Run a block with the simulated accelerator (see the module docstring)."""
    record = SimRecord()
    real_generator = torch.Generator
    mode = _Mode(record)
    torch.Generator = _SimGenerator
    _ACTIVE.append(mode)
    # module.to(dtype) assigns ``param.data``, which would change only the wrapper's metadata of
    # a simulated tensor; swapping the parameters converts the tensor it holds as well
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with _GeneratorCheck(mode._fail, record), mode:
            yield record
    finally:
        torch.Generator = real_generator
        torch.__future__.set_swap_module_params_on_conversion(swap)
        _ACTIVE.remove(mode)
