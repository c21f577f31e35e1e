"""A strict array that behaves as CuPy's does, for testing the device path without a GPU.

``Strict`` wraps a NumPy array and speaks NumPy's dispatch protocols (NEP-13
``__array_ufunc__``, NEP-18 ``__array_function__``, NEP-35 ``like=``), forwarding every
call to NumPy on the wrapped data. Like a CuPy array it refuses to become a NumPy array
implicitly (``__array__`` raises ``TypeError``) and refuses to be mixed with one in an
operation. Every read of its data by the host is counted in ``Strict.reads``: ``float``,
``int``, ``bool``, ``.item()``, ``.get()``, ``.tolist()``, boolean-mask indexing,
``nonzero`` and ``unique`` (whose result sizes depend on the data, so a GPU must
synchronise to know them).

``register()`` makes it the library's device ``"strict"``, so ``model.to("strict")``
moves a model onto it.
"""
from __future__ import annotations

import numpy as np

# NumPy functions whose output shape depends on the data: a device must read it.
DATA_DEPENDENT = {np.nonzero, np.flatnonzero, np.argwhere, np.unique, np.extract,
                  np.compress}


class HostConversionError(TypeError):
    """An implicit conversion of a device array to the host."""


def _unwrap(obj, *, where: str):
    if isinstance(obj, Strict):
        return obj.a
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{where}: a numpy.ndarray {obj.shape} {obj.dtype} mixed with "
                        "device arrays (CuPy refuses this too)")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, where=where) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v, where=where) for k, v in obj.items()}
    return obj


def _wrap(obj):
    if isinstance(obj, np.ndarray):
        return Strict(obj)
    if isinstance(obj, np.generic):  # a reduction's scalar: a 0-d array on the device
        return Strict(np.asarray(obj))
    if isinstance(obj, tuple):
        return tuple(_wrap(o) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o) for o in obj]
    return obj


class Strict(np.lib.mixins.NDArrayOperatorsMixin):
    """An array on a pretend device: NumPy's protocols work, host conversion does not."""

    __slots__ = ("a",)
    reads = 0  # host reads since the last reset()

    def __init__(self, a: np.ndarray) -> None:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"Strict wraps a numpy.ndarray, got {type(a).__name__}")
        self.a = a

    @classmethod
    def reset(cls) -> None:
        cls.reads = 0

    # ---- the dispatch protocols
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"np.{ufunc.__name__}"
        args = _unwrap(inputs, where=where)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _unwrap(out, where=where)
        if "where" in kwargs:
            kwargs["where"] = _unwrap(kwargs["where"], where=where)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        where = f"np.{func.__name__}"
        if func in DATA_DEPENDENT:
            Strict.reads += 1
        args, kwargs = _unwrap(args, where=where), _unwrap(kwargs, where=where)
        result = func(*args, **kwargs)
        if func is np.copyto:
            return None
        if func is np.count_nonzero and isinstance(result, int):
            return Strict(np.asarray(result))  # CuPy's count stays on the device too
        return _wrap(result)

    def __array__(self, dtype=None, copy=None):
        raise HostConversionError("implicit conversion of a device array to a NumPy array "
                                  "(use an explicit host read)")

    # ---- host reads, counted
    def _read(self) -> np.ndarray:
        Strict.reads += 1
        return self.a

    def get(self) -> np.ndarray:
        return self._read().copy()

    def item(self):
        return self._read().item()

    def tolist(self):
        return self._read().tolist()

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __index__(self) -> int:
        if self.a.ndim or self.a.dtype.kind not in "iu":
            raise TypeError("only integer scalar arrays can be converted to an index")
        return int(self._read())

    def __bool__(self) -> bool:
        return bool(self._read())

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    def __len__(self) -> int:
        return len(self.a)

    def __repr__(self) -> str:
        return f"Strict(shape={self.a.shape}, dtype={self.a.dtype})"

    # ---- metadata: free
    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    itemsize = property(lambda self: self.a.itemsize)
    strides = property(lambda self: self.a.strides)
    T = property(lambda self: Strict(self.a.T))
    mT = property(lambda self: Strict(self.a.mT))

    @property
    def base(self):
        return None if self.a.base is None else Strict(self.a.base)

    # ---- indexing
    def _key(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        for k in keys:
            if isinstance(k, Strict) and k.dtype == bool:
                Strict.reads += 1  # the result's size depends on the mask's data
        return _unwrap(key, where="indexing")

    def __getitem__(self, key):
        return Strict(np.asarray(self.a[self._key(key)]))

    def __setitem__(self, key, value) -> None:
        self.a[self._key(key)] = _unwrap(value, where="assignment")

    # ---- methods, as NumPy's (and CuPy's) arrays have them
    def reshape(self, *shape, **kw):
        return Strict(self.a.reshape(*shape, **kw))

    def transpose(self, *axes):
        return Strict(self.a.transpose(*axes))

    def swapaxes(self, a1, a2):
        return Strict(self.a.swapaxes(a1, a2))

    def astype(self, dtype, copy=True, **kw):
        return Strict(self.a.astype(dtype, copy=copy, **kw))

    def view(self, *args, **kw):
        return Strict(self.a.view(*args, **kw))

    def copy(self):
        return Strict(self.a.copy())

    def ravel(self):
        return Strict(self.a.ravel())

    def fill(self, value) -> None:
        self.a.fill(value)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()


def _reduction(name):
    def method(self, *args, **kwargs):
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _unwrap(out, where=f".{name}")
        result = getattr(self.a, name)(*args, **kwargs)
        return out if out is not None else _wrap(result)
    method.__name__ = name
    return method


for _name in ("sum", "mean", "max", "min", "any", "all", "argmax", "argmin", "var", "std",
              "prod", "cumsum", "dot", "squeeze", "clip", "round"):
    setattr(Strict, _name, _reduction(_name))


def strict(x):
    """A host array (or a nested structure of them) moved onto the strict device."""
    if isinstance(x, np.ndarray):
        return Strict(x.copy())
    if isinstance(x, (list, tuple)):
        return type(x)(strict(v) for v in x)
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    return x


def to_host(x) -> np.ndarray:
    """The explicit read that brings a strict array back (counted)."""
    return x.get()


def register() -> None:
    """Make ``Strict`` the library's device ``"strict"``."""
    from npformer.module import register_device

    register_device("strict", Strict, to=lambda a: Strict(np.array(a, copy=True)),
                    to_host=lambda x: x.get())
