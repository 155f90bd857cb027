"""The ``dlwatch`` command: parse, run one subcommand, print errors, pick exit codes.

Each subcommand is a module in this package with ``add_arguments(parser)`` and
``run(args) -> int``; its docstring's first line is its ``--help`` summary.
This is the only place that configures logging and turns errors into exit codes.
May import anything; only ``run_cmd`` imports ``dlwatch.inproc`` (``dlwatch run``'s bootstrap) and only
``tune_cmd`` names ``dlwatch.tuning`` (``dlwatch tune``'s bootstrap).

Exit codes: 0 ok; 1 internal error; 2 usage; 3 not found; 4 not an inspectable
target; 5 permission denied; 6 damaged or too-new report; 7 malformed playbook.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from dlwatch._version import __version__
from dlwatch.errors import DlwatchError

COMMANDS = ("run", "tune", "top", "report", "attach", "playbooks", "demo")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every usage error
        self.exit(2, f"dlwatch: error: {message} (see `{self.prog} --help`)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with ``only`` one command's parser in it (the others' modules not imported:
    ``dlwatch run`` starts the user's program sooner without report, forensics and top's imports)."""
    parser = _Parser(prog="dlwatch", description="Diagnose PyTorch DataLoader hangs, leaks and crashes.")
    parser.add_argument("--version", action="version", version=f"dlwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS if only is None else (only,):
        try:
            module = importlib.import_module(f"dlwatch.cli.{name}_cmd")
        except ModuleNotFoundError as exc:  # a command not built yet must not break the others
            if exc.name != f"dlwatch.cli.{name}_cmd":
                raise
            continue
        doc = (module.__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else name
        p = sub.add_parser(name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dlwatch._log import configure_own_process

    configure_own_process()
    words = list(sys.argv[1:] if argv is None else argv)
    # a command named first needs only its own module; anything else (help, --version, a typo
    # that argparse answers with the list of commands) gets the whole parser
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(words)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args))
    except DlwatchError as exc:
        from dlwatch.redact import outbound
        from dlwatch.report.render import terminal_line  # messages name paths and pids a user chose

        print(terminal_line(outbound(f"dlwatch: error: {exc}")), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
