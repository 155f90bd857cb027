"""Exec a command with ptrace and process_vm_readv denied by a seccomp filter (EPERM from the kernel).

Root holds CAP_SYS_PTRACE and this machine has no Yama, so "ptrace denied" has to be
made for real another way: this is what py-spy meets in a locked-down container.
x86_64 only.  usage: seccomp_exec.py PROGRAM [ARGS...]
"""

import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
ALLOW = 0x7FFF0000
ERRNO_EPERM = 0x00050000 | 1
LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
PTRACE, VM_READV, VM_WRITEV = 101, 310, 311


def install() -> None:
    if platform.machine() != "x86_64":
        raise SystemExit("seccomp_exec: x86_64 only")
    prog = [
        (LD_ABS, 0, 0, 4),
        (JEQ, 0, 4, AUDIT_ARCH_X86_64),  # other arch: allow
        (LD_ABS, 0, 0, 0),
        (JEQ, 3, 0, PTRACE),
        (JEQ, 2, 0, VM_READV),
        (JEQ, 1, 0, VM_WRITEV),
        (RET, 0, 0, ALLOW),
        (RET, 0, 0, ERRNO_EPERM),
    ]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


if __name__ == "__main__":
    install()
    os.execvp(sys.argv[1], sys.argv[1:])
