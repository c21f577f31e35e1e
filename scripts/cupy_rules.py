#!/usr/bin/env python3
"""Write CuPy's dispatch rules as a table the strict array reads: src/npformer/cupy_rules.json.

    python3 -m venv /tmp/cupyvenv
    /tmp/cupyvenv/bin/pip install cupy-cuda13x==14.2.0 numpy scipy
    /tmp/cupyvenv/bin/python scripts/cupy_rules.py            # writes the table
    /tmp/cupyvenv/bin/python scripts/cupy_rules.py --check    # exit 1 if it differs

CuPy imports without a GPU, and every rule below is read from the installed package
before any device is touched. The rules are those of ``cupy/_core/core.pyx`` (v14.2.0):

- ``ndarray.__array_ufunc__`` finds a NumPy ufunc by its name, as ``cupy.<name>`` or else
  ``cupyx.scipy.special.<name>``, takes the method of that name from it, and calls it with
  NumPy's arguments (``out`` unwrapped from its tuple). CuPy's ``ufunc.__call__``
  (``cupy/_core/_kernel.pyx``) takes the keywords ``out``, ``dtype`` and ``casting`` and
  refuses any other; ``reduce``, ``accumulate``, ``reduceat`` and ``at`` are defined on
  every ufunc but raise NotImplementedError except for a few. Which keywords and methods
  each ufunc takes is probed here, on the installed objects.
- ``ndarray.__array_function__`` finds a NumPy function by its module path and name
  (``numpy.linalg.norm`` -> ``cupy.linalg.norm``) and calls it with NumPy's arguments
  exactly as given, so a keyword the CuPy function does not take fails. Its parameters
  come from ``inspect.signature`` (or, for a compiled function, its docstring's first
  line). A name CuPy lacks, or one that is NumPy's own function, is not handled.
- ``cupy.ndarray``'s methods, with their parameters from their docstrings.

CI needs no CuPy: it reads the committed table. Rerun this script when CuPy is upgraded.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import re
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "src" / "npformer" / "cupy_rules.json"
# The NumPy namespaces whose functions dispatch (NEP 18), searched for functions.
NUMPY_MODULES = ("numpy", "numpy.linalg", "numpy.fft", "numpy.lib.stride_tricks",
                 "numpy.lib.scimath")
# Every keyword NumPy's ufunc machinery can hand to __array_ufunc__ with "__call__".
UFUNC_KEYWORDS = ("out", "where", "axes", "axis", "keepdims", "casting", "order", "dtype",
                  "subok", "signature")
UFUNC_METHODS = ("outer", "reduce", "accumulate", "reduceat", "at")


class Reached(Exception):
    """Raised by a probe object: CuPy's method went past its refusal."""


class Probe:
    """An argument that stops a CuPy method at its first use of the array."""

    def __getattr__(self, name):
        raise Reached(name)


def params_of_signature(sig: inspect.Signature) -> list[str]:
    """A signature as a list of strings: "a", "axis=" (has a default), "*args", "*" (the
    keyword-only ones follow), "**kwargs", "/" (the ones before are positional only)."""
    out, star = [], False
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    for k, p in enumerate(params):
        if p.kind is kinds.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is kinds.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is kinds.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name + ("=" if p.default is not p.empty else ""))
            last = k + 1 == len(params) or params[k + 1].kind is not kinds.POSITIONAL_ONLY
            if p.kind is kinds.POSITIONAL_ONLY and last:
                out.append("/")
    return out


def split_top(text: str) -> list[str]:
    """text split at the commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def params_of_docstring(obj) -> list[str] | None:
    """The parameters in a compiled function's docstring, ``name(self, a, b=1)``: C types
    before a name (``Py_ssize_t axis1``) are dropped; None if there is none."""
    first = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    m = re.match(r"^[\w.]+\((.*)\)(\s*->.*)?$", first[0]) if first else None
    if m is None:
        return None
    out = []
    for part in split_top(m.group(1)):
        head, eq, _ = part.partition("=")
        name = head.split()[-1]
        if name != "self":
            out.append(name + ("=" if eq else ""))
    return out


def params_of(obj) -> list[str] | None:
    try:
        return params_of_signature(inspect.signature(obj))
    except (TypeError, ValueError):
        return params_of_docstring(obj)


def ufunc_rules(cupy, special, name: str) -> dict | None:
    """CuPy's object for the NumPy ufunc ``name`` and what NumPy may call on it."""
    func = getattr(cupy, name, None) or getattr(special, name, None)
    if func is None:
        return None
    where = "cupy" if getattr(cupy, name, None) is not None else "cupyx.scipy.special"
    rule = {"cupy": f"{where}.{name}", "methods": {}}
    if isinstance(func, cupy.ufunc):
        rule.update(nin=func.nin, nout=func.nout, call=[])
        for kw in UFUNC_KEYWORDS:  # refused keywords raise 'Wrong arguments' first
            try:
                func(**{kw: None})
            except TypeError as err:
                if not str(err).startswith("Wrong arguments"):
                    rule["call"].append(kw)
        for method in UFUNC_METHODS:
            bound = getattr(func, method)
            n_required = sum(1 for p in params_of_docstring(bound) if not p.endswith("="))
            try:
                bound(*(Probe() for _ in range(n_required)))
            except NotImplementedError:
                continue  # defined, but refused for this ufunc
            except Exception:
                pass  # it went on to use its arguments: supported
            rule["methods"][method] = params_of_docstring(bound)
    else:  # a generalised ufunc or a plain function under a ufunc's name
        rule["call"] = params_of(func.__call__ if not inspect.isroutine(func) else func)
        for method in UFUNC_METHODS:
            if hasattr(func, method):
                rule["methods"][method] = params_of(getattr(func, method))
    return rule


def numpy_functions() -> dict[str, object]:
    """NumPy's functions that __array_function__ can receive: its dispatchers, and the
    creators that take like= (NEP 35), by ``module.name`` as CuPy looks them up."""
    dispatcher = type(np.sum)
    found = {}
    for modname in NUMPY_MODULES:
        mod = functools.reduce(getattr, modname.split(".")[1:], np)
        for name in dir(mod):
            if name.startswith("_"):
                continue
            try:
                obj = getattr(mod, name)
            except AttributeError:
                continue
            if isinstance(obj, (type, np.ufunc)) or not callable(obj):
                continue
            if not isinstance(obj, dispatcher):
                try:
                    if "like" not in inspect.signature(obj).parameters:
                        continue
                except (TypeError, ValueError):
                    continue
            found[f"{obj.__module__}.{obj.__name__}"] = obj
    return dict(sorted(found.items()))


def build() -> dict:
    import cupy
    import cupyx.scipy.special as special
    import scipy.special

    ufunc_names = sorted({u.__name__ for mod in (np, scipy.special) for u in vars(mod).values()
                          if isinstance(u, np.ufunc)})
    ufuncs, missing_ufuncs = {}, []
    for name in ufunc_names:
        rule = ufunc_rules(cupy, special, name)
        if rule is None:
            missing_ufuncs.append(name)
        else:
            ufuncs[name] = rule
    functions, missing = {}, []
    for key, func in numpy_functions().items():
        module, _, name = key.rpartition(".")
        try:  # core.pyx: functools.reduce(getattr, func.__module__.split('.')[1:], cupy)
            cupy_func = getattr(functools.reduce(getattr, module.split(".")[1:], cupy), name)
        except AttributeError:
            missing.append(key)
            continue
        if cupy_func is func:  # NumPy's own function re-exported: CuPy declines it
            missing.append(key)
            continue
        functions[key] = {"cupy": "cupy" + key[len("numpy"):], "params": params_of(cupy_func)}
    methods, attributes = {}, []
    for name in sorted(dir(cupy.ndarray)):
        if name.startswith("_"):
            continue
        obj = getattr(cupy.ndarray, name)
        if callable(obj):
            methods[name] = params_of_docstring(obj)
        else:
            attributes.append(name)
    return {
        "about": "CuPy's dispatch rules for npformer.strict, written by scripts/cupy_rules.py "
                 "from the installed CuPy; do not edit",
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "ufuncs": ufuncs,
        "ufuncs_missing": missing_ufuncs,
        "functions": functions,
        "functions_missing": missing,
        "methods": methods,
        "attributes": attributes,
    }


def dumps(table: dict) -> str:
    """JSON with one line per ufunc, function or method, so that a diff reads by name."""
    lines = []
    for key, value in table.items():
        if isinstance(value, dict):
            inner = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f" {json.dumps(key)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the "
                        "committed table differs from the installed CuPy's")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = dumps(build())
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the installed CuPy'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
