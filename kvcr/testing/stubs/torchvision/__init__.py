"""Import-only stand-in for ``torchvision`` (kvcr test environment).

Why: SGLang 0.5.23's config modules (``srt.configs.deepseek_ocr``, ``srt.multimodal.internvl_utils``,
reached from ``mem_cache.pool_host.*``) import torchvision at module level, and transformers 5.x then
imports ``torchvision.transforms.v2.functional`` / ``torchvision.io`` when it sees torchvision present.
PyPI's torchvision wheels are built against CUDA torch and fail to load next to torch 2.13.0+cpu
(``operator torchvision::nms does not exist``), so the kvcr test environment puts this package on
``sys.path`` (``kvcr/testing/stubs``, shipped in the wheel for the demo and benchmarks) instead of
installing torchvision.

What it does:
* every ``torchvision.<anything>`` submodule imports (a meta-path finder makes an empty package for it);
* every public attribute of such a module is a *placeholder class*: attribute access on it yields
  further placeholders (``InterpolationMode.BICUBIC``), it can be used in annotations, as a dict key or
  as a base class, but *calling* it raises ``RuntimeError`` -- nothing here computes anything;
* ``torchvision.__version__`` and the sibling ``torchvision-0.0.0+stub.dist-info`` report version
  ``0.0.0+stub`` (transformers reads it through ``importlib.metadata.version``);
* ``torchvision.KVCR_STUB is True`` lets a test tell the stub from a real install.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+stub"
KVCR_STUB = True

_PREFIX = __name__ + "."


class _PlaceholderMeta(type):
    """Metaclass of placeholder classes: permissive attribute access, refusing calls."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _make_placeholder(name, f"{cls.__qualname__}.{name}", cls.__module__)
        setattr(cls, name, child)
        return child

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{cls.__module__}.{cls.__qualname__} is a placeholder from kvcr's import-only torchvision "
            "stub (kvcr/testing/stubs); real torchvision is not installed in this environment"
        )

    def __repr__(cls) -> str:
        return f"<torchvision stub placeholder {cls.__module__}.{cls.__qualname__}>"


def _make_placeholder(name: str, qualname: str, module: str) -> type:
    ph = _PlaceholderMeta(name, (), {"__module__": module, "__qualname__": qualname})
    return ph


class _StubModule(types.ModuleType):
    """A ``torchvision.*`` submodule whose public attributes are placeholders."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = sys.modules.get(f"{self.__name__}.{name}")
        if sub is not None:
            return sub
        ph = _make_placeholder(name, name, self.__name__)
        setattr(self, name, ph)
        return ph


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision.<sub>`` import with an empty stub package."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # a package, so deeper submodules import too
        module.__file__ = None
        if module.__name__ == _PREFIX + "version":
            module.__version__ = __version__  # type: ignore[attr-defined]
            module.git_version = "stub"  # type: ignore[attr-defined]
            module.cuda = None  # type: ignore[attr-defined]


def _install() -> None:
    for finder in sys.meta_path:
        if type(finder).__name__ == "_StubFinder" and getattr(finder, "_kvcr_torchvision_stub", False):
            return
    finder = _StubFinder()
    finder._kvcr_torchvision_stub = True  # type: ignore[attr-defined]
    sys.meta_path.insert(0, finder)


_install()

# Top-level helpers real torchvision exposes and that some callers invoke at import time.
disable_beta_transforms_warning = _no_op
set_image_backend = _no_op
set_video_backend = _no_op


def get_image_backend() -> str:
    return "PIL"


def get_video_backend() -> str:
    return "pyav"


def __getattr__(name: str) -> Any:
    """Module-level attribute fallback: submodules (if imported) or placeholders."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    sub = sys.modules.get(_PREFIX + name)
    if sub is not None:
        return sub
    ph = _make_placeholder(name, name, __name__)
    globals()[name] = ph
    return ph
