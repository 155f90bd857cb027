"""dlwatch tune's bootstrap: the only module in its directory, which ``dlwatch tune`` puts on PYTHONPATH.

Python imports ``sitecustomize`` at startup.  In the process ``dlwatch tune`` became (the pid it
recorded in ``DLWATCH_TUNE``) and only in an interpreter where ``import dlwatch`` finds the very
package ``dlwatch tune`` recorded (``DLWATCH_TUNE_PACKAGE``), it installs the hook that tunes the
script's DataLoader (dlwatch.tuning.hook), which also gives the environment back as it was.
Anywhere else it does nothing.  The sitecustomize it shadows, if any, still runs.  It does
nothing under ``-I``/``-E`` (the environment is ignored there).  The same shape as ``dlwatch
run``'s bootstrap (dlwatch/inproc/_boot), kept apart so that neither command's hook is loaded
by the other.
"""


def _belongs(package: str) -> bool:
    import importlib.util
    import os

    recorded = os.environ.get("DLWATCH_TUNE_PACKAGE") or package
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

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        if os.environ.get("DLWATCH_TUNE") and _belongs(os.path.dirname(os.path.dirname(here))):
            from dlwatch.tuning import hook

            hook.install()
    except Exception as exc:  # never stop the program silently: say why nothing will be tuned
        sys.stderr.write(f"dlwatch: error: could not install the tune hook ({type(exc).__name__})\n")
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
