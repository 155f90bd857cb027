"""One error root for everything dlwatch refuses; each error carries its fix.

Only ``dlwatch.cli.main`` prints these and picks exit codes.  In the training
process they are raised only for bad arguments to ``watch`` (as ValueError or
TypeError subclasses, so that ``except ValueError`` works as users expect).
"""

from __future__ import annotations

PTRACE_HELP = (
    "allow ptrace for dlwatch: run as the same user with CAP_SYS_PTRACE "
    "(Docker: --cap-add=SYS_PTRACE; Kubernetes: securityContext.capabilities.add: [SYS_PTRACE]), "
    "or lower Yama with `sysctl kernel.yama.ptrace_scope=0`, or call "
    "prctl(PR_SET_PTRACER, <monitor pid>) in the traced process (dlwatch.watch does this itself)"
)


class DlwatchError(Exception):
    """Base of dlwatch's own errors. ``help`` says what to do about it."""

    exit_code = 1

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help

    def __str__(self) -> str:
        return f"{self.message}; {self.help}" if self.help else self.message


class UsageError(DlwatchError):
    """Bad command-line input (exit 2)."""

    exit_code = 2


class NotFoundError(DlwatchError):
    """A path, report id or process that does not exist (exit 3)."""

    exit_code = 3


class TargetError(DlwatchError):
    """A process that cannot be inspected: not Python, a zombie, a kernel thread (exit 4)."""

    exit_code = 4


class PermissionDeniedError(DlwatchError):
    """The OS refused access (exit 5)."""

    exit_code = 5


class ReportError(DlwatchError):
    """A damaged, truncated or too-new report (exit 6)."""

    exit_code = 6


class PlaybookError(DlwatchError, ValueError):
    """A malformed playbook file; names the file and the field (exit 7)."""

    exit_code = 7

    def __init__(self, path: str, field: str, problem: str) -> None:
        super().__init__(
            f"playbook {path}: field {field!r}: {problem}", help="fix the file or remove it from the playbook directory"
        )
        self.path = path
        self.field = field
