"""Block-sparse index format (lists per query block) and the mask families' builders (PSA
stripes, sliding tiles, ...). Pure PyTorch.

Re-exported by declaration: every public module of this package (helpers start with ``_``)
lists its public names in ``__all__``, and they are all importable from ``vidsparse.masks``,
so a new mask family's module needs no edit here.
"""

import importlib as _importlib
import pkgutil as _pkgutil

__all__: list[str] = []

for _info in _pkgutil.iter_modules(__path__):
    if _info.name.startswith("_"):
        continue
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:
        if _name in globals():
            raise ImportError(f"vidsparse.masks: {_info.name} exports {_name!r} a second time")
        globals()[_name] = getattr(_module, _name)
    __all__ += _module.__all__
