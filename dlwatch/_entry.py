"""``python -m dlwatch ...``: take the working directory and the user site off ``sys.path`` first.

``python -m`` puts the working directory first on ``sys.path`` before it imports the package
named on its command line, and the package's ``__init__`` is the first code of dlwatch that
runs.  Run by root in a job owner's directory, every module dlwatch imported from then on
(``typing``, ``json``, ``argparse``, ``subprocess``, ``re2``, ``psutil`` ...) could be a file
the owner left there.  So ``dlwatch/__init__.py`` calls :func:`isolate` before its first
import whenever dlwatch itself is the ``-m`` module: the working directory (the entry ``-m``
added, and any other entry that is that directory) and the user site leave ``sys.path``;
the directories where dlwatch's dependencies were found are appended again, after the
standard library and site-packages, as the monitor's bootstrap does (``_spawn``).  Nothing
else of the process changes: its interpreter options and environment stay as given, and a
program ``dlwatch run`` starts is a fresh interpreter with its own, ordinary ``sys.path``.

Before this runs, Python has imported only what it needs to start and to run ``-m``
(frozen or built in, or loaded before the working directory was on the path):
``tests/test_hardening.py`` plants a module for every standard-library name and every
dependency in the working directory and checks that none of them runs.  What no code of
dlwatch can stop: a ``dlwatch`` package or ``dlwatch.py`` in the working directory is what
``python -m dlwatch`` runs in place of this one (use the ``dlwatch`` command, or
``python -P -m dlwatch``, in a directory other users can write).

Only ``sys`` and ``os`` (both loaded before any ``-m`` module) and ``importlib.machinery``
(loaded by runpy) are used here: importing anything else would be the very import this
module exists to prevent.
"""

import os
import sys

if False:  # typing only (no import at run time: see above)
    import types

# dlwatch's dependencies (pyproject.toml), and the optional ones it imports when present
DEPENDENCIES = ("psutil", "structlog", "re2", "pynvml", "tomli", "prometheus_client")


def running_as_main_module() -> bool:
    """Whether this process is ``python -m dlwatch`` (or ``-m dlwatch.<module>``), still finding its module."""
    if sys.argv[:1] != ["-m"]:  # runpy sets argv[0] to "-m" only while it imports the -m module's packages
        return False
    frame: "types.FrameType | None" = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_run_module_as_main" and frame.f_globals.get("__name__") == "runpy":
            name = frame.f_locals.get("mod_name")
            return isinstance(name, str) and (name == "dlwatch" or name.startswith("dlwatch."))
        frame = frame.f_back
    return False


def working_dir() -> "str | None":
    try:
        return os.path.realpath(os.getcwd())
    except OSError:  # removed under us: Python could not put it on the path either
        return None


def _user_site() -> "str | None":
    site = sys.modules.get("site")
    user = getattr(site, "USER_SITE", None) if site is not None else None
    return os.path.normpath(user) if isinstance(user, str) and os.path.isabs(user) else None


def _is_cwd_entry(entry: object, cwd: "str | None") -> bool:
    """'' and relative entries resolve against the working directory; so does its absolute name."""
    if not isinstance(entry, str):
        return False
    if not entry or not os.path.isabs(entry):
        # a path hook of an installed package may claim a name that is no directory (setuptools'
        # editable installs): kept when one did, dropped when a plain FileFinder would read the cwd
        from importlib.machinery import FileFinder  # loaded already: runpy imports it

        importer = sys.path_importer_cache.get(entry)
        return entry == "" or importer is None or isinstance(importer, FileFinder)
    if cwd is None:
        return False
    try:
        return os.path.realpath(entry) == cwd
    except (OSError, ValueError):
        return True


def without_cwd(path: "list[str]", cwd: "str | None") -> "list[str]":
    """``path`` without its entries that name the working directory ``cwd`` (''/relative ones included)."""
    return [entry for entry in path if not _is_cwd_entry(entry, cwd)]


def isolated_path(path: "list[str]", cwd: "str | None", user_site: "str | None") -> "list[str]":
    """``path`` without the working directory and the user site; dependencies found only there come last."""
    kept: "list[str]" = []
    dropped: "list[str]" = []
    for entry in without_cwd(path, cwd):
        if user_site and isinstance(entry, str) and os.path.isabs(entry) and os.path.normpath(entry) == user_site:
            dropped.append(entry)
            continue
        kept.append(entry)
    if dropped:
        from importlib.machinery import PathFinder  # loaded already: runpy imports it

        for name in DEPENDENCIES:
            try:
                if PathFinder.find_spec(name, [e for e in kept if isinstance(e, str)]) is not None:
                    continue
                for entry in dropped:
                    if entry not in kept and PathFinder.find_spec(name, [entry]) is not None:
                        kept.append(entry)
                        break
            except (ImportError, ValueError, OSError):
                continue
    return kept


def isolate() -> None:
    """Take the working directory and the user site off ``sys.path`` (see the module's docstring)."""
    sys.path[:] = isolated_path(list(sys.path), working_dir(), _user_site())
