"""dlwatch run's bootstrap: the only module in its directory, which ``dlwatch run`` puts on PYTHONPATH.

Python imports ``sitecustomize`` at startup, so every Python process of the program
(the script itself, torchrun's ranks, spawned helpers) gets here.  It only registers
an import hook that watches DataLoader iterations once torch's DataLoader is
imported (dlwatch.inproc.runhook), then runs the sitecustomize this one shadows, if any.
It does nothing when DLWATCH_DISABLE=1 or when the interpreter ignores the
environment (``-I``/``-E``: dlwatch's own monitor and helpers run so, and are never hooked).

PYTHONPATH reaches every child, also interpreters that are not the program's: the system
Python the program starts, a tool's own virtualenv.  The bootstrap acts only in an
interpreter it belongs to: one where ``import dlwatch`` finds the very package ``dlwatch run``
recorded in ``DLWATCH_RUN_PACKAGE`` (this bootstrap's own package when unset).  Anywhere else
it stays silent and does nothing (no import of a dlwatch found elsewhere, no warning); the
sitecustomize it shadows still runs.
"""


def _belongs(package: str) -> bool:
    """Whether ``import dlwatch`` here would load the package ``dlwatch run`` recorded (found, not imported)."""
    import importlib.util
    import os

    recorded = os.environ.get("DLWATCH_RUN_PACKAGE") or package  # the name run_cmd.PACKAGE_ENV sets
    try:
        spec = importlib.util.find_spec("dlwatch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    return os.path.realpath(os.path.dirname(spec.origin)) == os.path.realpath(recorded)


def _boot() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))  # absolute: PYTHONPATH's entries are made so at start
    # this directory holds nothing else the program should import: take it off the path again (relative
    # entries are not it: never resolved here, where the working directory may be gone, as python allows)
    sys.path[:] = [p for p in sys.path if not (os.path.isabs(p) and os.path.normpath(p) == here)]
    try:
        if _belongs(os.path.dirname(os.path.dirname(here))):  # dlwatch/ (this is dlwatch/inproc/_boot)
            from dlwatch.inproc import runhook

            runhook.install()
    except Exception as exc:  # never stop the program: it runs unwatched
        line = (
            f"dlwatch: warning: could not install the run hook ({type(exc).__name__}: {exc}); "
            "the program runs unwatched\n"
        )
        try:  # the one redaction point: the message can hold a path or a value of the program
            from dlwatch.redact import outbound

            line = outbound(line)
        except Exception:  # dlwatch itself cannot be imported: say so without the message
            line = (
                f"dlwatch: warning: could not install the run hook ({type(exc).__name__}); the program runs unwatched\n"
            )
        sys.stderr.write(line)
    # the sitecustomize this one shadows (a distribution's or a site's) still runs
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if (
        spec is not None
        and spec.loader is not None
        and spec.origin
        and os.path.dirname(os.path.abspath(spec.origin)) != here
    ):
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_boot()
del _boot
