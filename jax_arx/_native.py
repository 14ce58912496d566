"""jax_arx's C++ module, ``jax_arx._core``: imported on first use, so that
jax_arx imports (and falls back to jax.lax) where it is not built, and its
FFI handlers registered with XLA. The one place that imports it: every
other module asks ``core()``. Tests put a stand-in in ``_core_module``.
"""

from __future__ import annotations

import importlib.machinery
import os
import pathlib
import sys
from typing import Any

import jax

from jax_arx.errors import InitializationError

# Tests put a stand-in in _core_module (tests/stand_in_core.py).
_core_module: Any = None
_core_import_error: ImportError | None = None
_ffi_targets_registered: list = []  # the modules whose handlers XLA knows


def core(required: bool = True):
    """The C++ module; None where it is not built and ``required`` is
    False. Raises InitializationError, saying why and what to do, where it
    is not built and ``required`` is True."""
    global _core_module, _core_import_error
    if _core_module is None and _core_import_error is None:
        try:
            from jax_arx import _core as module
        except ImportError as e:
            _core_import_error = e
        else:
            _core_module = module
    if _core_module is None and required:
        raise InitializationError(
            f"jax_arx's C++ module jax_arx._core could not be imported ({_core_import_error}). "
            + core_missing_hint(list(sys.modules["jax_arx"].__path__), sys.path)
            + " Until then jax_arx.psum falls back to jax.lax.psum."
        ) from _core_import_error
    return _core_module


def core_missing_hint(package_path: list[str], search_path: list[str]) -> str:
    """What to do about a missing ``_core``, given the folders jax_arx's
    modules are looked up in (its ``__path__``) and ``sys.path``. The common
    cause is not a missing build: a script saved in the checkout's top
    folder (or ``python -m``/``-c`` run there) puts that folder first on
    ``sys.path``, so Python imports the source folder ``jax_arx/``, which
    holds no built module, ahead of the installed package."""
    build = (
        "Build and install it from the jax_arx source tree with `pip install .` (needs CMake >= 3.24, a "
        "C++20 compiler, and nvcc for GPUs)."
    )
    package = pathlib.Path(package_path[0])
    root = package.parent
    checkout = (root / "pyproject.toml").is_file() and (root / "ffi").is_dir()
    if not checkout or any(any(pathlib.Path(p).glob("_core*")) for p in package_path):
        return build  # not shadowed: the module is not built, or does not load
    elsewhere = [p for p in search_path if pathlib.Path(p or os.getcwd()).resolve() != root.resolve()]
    spec = importlib.machinery.PathFinder.find_spec("jax_arx", elsewhere)
    installed = (
        f", not the installed one ({pathlib.Path(spec.origin).parent})" if spec is not None and spec.origin else ""
    )
    return (
        f"Python imported jax_arx from its source tree ({package}){installed}, because {root} comes first "
        "on sys.path: it is the folder of the script, or the current folder under `python -m` or "
        "`python -c`. Save scripts outside that folder (a subfolder such as examples/ is fine), and run "
        "`python -m` and `python -c` from another folder" + ("." if installed else "; and install jax_arx: " + build)
    )


def register_ffi_targets() -> bool:
    """Registers the C++ handlers with XLA (``jax.ffi.register_ffi_target``)
    for every platform the module was built for, once per module (a test's
    stand-in registers its own). Called by ``jax_arx.initialize()``, before
    anything that calls the handlers is traced; returns False, registering
    nothing, when ``_core`` is not built."""
    core_module = core(required=False)
    if core_module is None:
        return False
    if not any(m is core_module for m in _ffi_targets_registered):
        for platform, targets in core_module.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _ffi_targets_registered.append(core_module)
    return True
