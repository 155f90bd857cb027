"""``dlwatch tune``'s hook in the script's process: tune its N-th DataLoader when it is first iterated, then end.

Installed by the bootstrap that ``dlwatch tune`` puts on PYTHONPATH (``dlwatch/tuning/_boot``),
only in the process ``dlwatch tune`` became (the pid it recorded): the script's own children,
its DataLoader workers and other interpreters are left alone, and the script's environment is
given back as it was (PYTHONPATH without the bootstrap, no ``DLWATCH_TUNE*`` variables).  When
torch's dataloader module is imported it wraps ``DataLoader.__iter__``; the loaders the script
iterates are counted in the order of their first iteration, and the N-th one is tuned right
there, inside its ``iter()``: before its first batch, so no training step ever runs on it.
Then the table and the recommended keywords go to stdout, the JSON and the page to the files
asked for, and the process ends (``os._exit``: nothing more of the script runs, not its
``finally`` blocks nor its atexit handlers; the workers of loaders it still iterates are
ended first).  Exit status 0, 130 after a Ctrl-C (the best so far is printed), 1 when the tune
itself failed, 3 when the script ended without iterating its N-th loader.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import json
import os
import sys
from typing import Any

ENV = "DLWATCH_TUNE"  # the options, as JSON (set by dlwatch/cli/tune_cmd.py)
TARGET_MODULE = "torch.utils.data.dataloader"

_options: dict[str, Any] = {}
_seen: list[int] = []  # id() of each loader, in the order of its first iteration
_done = False


class _Finder:
    """Notices torch's dataloader module being imported, once."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET_MODULE:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _patch(module.DataLoader)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """From the bootstrap: read the options, give the environment back, hook DataLoader."""
    global _options
    raw = os.environ.pop(ENV, None)
    pythonpath = os.environ.pop(ENV + "_PYTHONPATH", None)
    os.environ.pop(ENV + "_PACKAGE", None)
    if raw is None:
        return
    if pythonpath is not None:
        if pythonpath:
            os.environ["PYTHONPATH"] = pythonpath
        else:
            os.environ.pop("PYTHONPATH", None)
    opts = json.loads(raw)
    if opts.get("pid") != os.getpid():
        return  # a child of the script (it inherited the variable before it was removed): not ours
    _options = opts
    atexit.register(_never_reached)  # registered first: runs after the script's own exit handlers
    mod = sys.modules.get(TARGET_MODULE)
    if mod is not None and hasattr(mod, "DataLoader"):
        _patch(mod.DataLoader)
    else:
        sys.meta_path.insert(0, _Finder())


def _patch(cls: type) -> None:
    original = cls.__dict__["__iter__"]

    def __iter__(self: Any) -> Any:
        if not _done and _in_main_process_loader(self):
            ident = id(self)
            if ident not in _seen:
                _seen.append(ident)
                if len(_seen) == int(_options.get("loader") or 1):
                    cls.__iter__ = original  # type: ignore[method-assign]  # candidates iterate plainly
                    _tune_and_end(self)
        return original(self)

    __iter__.__wrapped__ = original  # type: ignore[attr-defined]
    __iter__.__doc__ = original.__doc__
    cls.__iter__ = __iter__  # type: ignore[method-assign]


def _in_main_process_loader(loader: Any) -> bool:
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is None and os.getpid() == _options.get("pid")
    except Exception:
        return False


def _say(text: str, stream: Any = None) -> None:
    from dlwatch.redact import outbound
    from dlwatch.report.render import terminal_safe

    print(terminal_safe(outbound(text)), file=stream or sys.stderr, flush=True)


def _tune_and_end(loader: Any) -> None:
    global _done
    _done = True
    code = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        from dlwatch.tuning.api import tune
        from dlwatch.tuning.render import kwargs_text

        result = tune(
            loader,
            budget_s=float(_options.get("budget_s") or 60.0),
            step_s=_options.get("step_s"),
            max_workers=_options.get("max_workers"),
            memory_budget=_options.get("memory_budget"),
            stall_s=_options.get("stall_s"),
            iterable_ok=bool(_options.get("iterable_ok")),
            progress=True,  # on stderr; plain lines when it is not a terminal
        )
        print(result.table(), flush=True)
        if result.recommended is not None:
            print(f"\nDataLoader keywords (all four): {kwargs_text(result.dataloader_kwargs())}", flush=True)
        code = _write_outputs(result)
        if result.interrupted:
            code = 130
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:
        _say(f"dlwatch: error: the tune failed: {type(exc).__name__}: {exc}")
        code = 1
    _end(code)


def _write_outputs(result: Any) -> int:
    from dlwatch._fs import replace_private
    from dlwatch.redact import outbound_bytes

    code = 0
    for key, render in (("json", lambda: json.dumps(result.to_dict(), indent=2) + "\n"), ("html", result.html)):
        path = _options.get(key)
        if not path:
            continue
        try:
            replace_private(path, outbound_bytes(render()))
            _say(f"dlwatch tune: {key.upper()} written: {path}")
        except OSError as exc:
            _say(f"dlwatch: error: could not write {path}: {exc.strerror or exc}")
            code = 1
    return code


def _end(code: int) -> None:
    """End the process now: the workers of loaders the script still iterates first, then os._exit."""
    try:
        import multiprocessing

        kids = [p for p in multiprocessing.active_children() if p.daemon]  # what Python's exit would end
        for p in kids:
            p.terminate()
        for p in kids:
            p.join(2.0)
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _never_reached() -> None:
    if _done:
        return
    n = int(_options.get("loader") or 1)
    if sys.exc_info()[1] is not None or getattr(sys, "last_value", None) is not None:
        return  # the script failed: its own traceback and exit status say so
    _say(
        f"dlwatch: error: the program ended without iterating its DataLoader #{n} "
        f"(it iterated {len(_seen)}); nothing was tuned"
    )
    _end(3)
