"""``dlwatch run``: what dlwatch imports inside the program's processes never comes from the program's directory.

The run hook is installed at interpreter start (``sitecustomize``), before Python puts the
program's own entry first on ``sys.path`` (the working directory for ``python -m``, the
script's directory for a script).  dlwatch's code then runs inside the program, and imports
lazily: the watch at the first loader iteration (``json``, ``mmap``, ``re2``, ``psutil`` ...),
more at exit.  Through the program's ``sys.path`` a ``re2.py`` or ``mmap.py`` left in a
world-writable working directory would run, as root if root runs the job, where the bare
program imports no such module.

:class:`OwnImports` is a meta-path finder that answers only for top-level imports made on
dlwatch's behalf, and resolves those in the path the interpreter had at start (standard
library, PYTHONPATH, site-packages, the user site), less the working directory: the program's
own entry cannot shadow them.  An import is dlwatch's when, walking out from the import, the
first frame that is neither the standard library nor one of dlwatch's dependencies is
dlwatch's own code.  The program's imports, including those its code makes while dlwatch
called it (a dataset's ``__getitem__``, a collate function, ``repr`` of a dataset) and those
torch makes for it (unpickling a batch whose class lives in the working directory), are
answered by Python exactly as bare: this finder returns None for them.  One difference is
left, by design: a module dlwatch imported is in ``sys.modules``, so a program that shadows
that very module with a file of its own gets the real one.
"""

from __future__ import annotations

import os
import sys
import threading
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any, Sequence

from dlwatch import _entry

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dlwatch/
_STDLIB = os.path.dirname(threading.__file__) + os.sep  # a source module of the standard library
_STDLIB_SITES = (_STDLIB + "site-packages" + os.sep, _STDLIB + "dist-packages" + os.sep)


class OwnImports:
    """The finder (see the module's docstring); ``path`` is where dlwatch's imports are looked up."""

    def __init__(self, path: Sequence[str]) -> None:
        self.path = list(path)
        self._deps: tuple[str, ...] | None = None

    def _dependencies(self) -> tuple[str, ...]:
        """Where dlwatch's dependencies live (found in ``path``): their frames are code dlwatch called."""
        if self._deps is None:
            found = []
            for name in _entry.DEPENDENCIES:
                try:
                    spec = PathFinder.find_spec(name, self.path)
                except (ImportError, ValueError, OSError):
                    continue
                if spec is None or not spec.origin:
                    continue
                if spec.submodule_search_locations is not None:
                    found.append(os.path.dirname(spec.origin) + os.sep)
                else:
                    found.append(spec.origin)
            self._deps = tuple(found)
        return self._deps

    def for_dlwatch(self, frame: Any) -> bool:
        """Whether the import made in ``frame`` (and the frames it was called from) is dlwatch's."""
        between: list[str] = []  # frames that are neither dlwatch's nor the standard library's
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(_PKG):
                # dlwatch's code imports, directly or through the libraries it called; any other code in
                # between (the program's, torch's) makes it the program's import
                return all(n.startswith(self._dependencies()) for n in between)
            if not name.startswith("<frozen ") and (not name.startswith(_STDLIB) or name.startswith(_STDLIB_SITES)):
                between.append(name)  # "<frozen ...>": importlib itself, runpy, os: the standard library
            frame = frame.f_back
        return False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if path is not None or not self.for_dlwatch(sys._getframe(1)):
            return None  # a submodule (found in its package) or the program's own import: Python's answer
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            if finder is PathFinder:
                spec = PathFinder.find_spec(name, self.path, target)
            else:
                find = getattr(finder, "find_spec", None)
                spec = find(name, None, target) if find is not None else None
            if spec is not None:
                return spec
        # not on the path dlwatch may import from: not from the program's directory either
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def install() -> None:
    """Put the finder first on ``sys.meta_path``; called at interpreter start, before the program's entry."""
    if any(isinstance(f, OwnImports) for f in sys.meta_path):
        return
    here = [p for p in _entry.without_cwd(list(sys.path), _entry.working_dir()) if isinstance(p, str)]
    sys.meta_path.insert(0, OwnImports(here))
