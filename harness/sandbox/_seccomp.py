"""The seccomp filter of every command run in a sandbox (see ``confine_thread``).

Commands run as the sandbox uid in the host's user namespace (the jail has
none of its own), so, unfiltered, they could create a user namespace of their
own (and be root with every capability over the mounts and files it holds,
the kernel's widest attack surface for an unprivileged process) and share the
kernel keyring of that uid with every other sandbox and with the host's own
user of that uid. As in Docker's default profile, a seccomp filter, which
every child inherits and none can drop, denies: unshare() and clone() with
CLONE_NEWUSER (EPERM), clone3() (ENOSYS: its flags are out of a filter's
reach; the C library then falls back to clone()), the keyring calls,
perf_event_open, bpf, and the module and kexec calls (EPERM). The filter is
installed on the host thread that spawns a command (see ``_exec``), so it
costs no process and no fork.
"""

from __future__ import annotations

import ctypes
import os

from harness.errors import SandboxUnavailable

_libc = ctypes.CDLL(None, use_errno=True)

_CLONE_NEWUSER = 0x10000000
_EPERM, _ENOSYS = 1, 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_JSET_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_X32_SYSCALL_BIT = 0x40000000

#: Per audit architecture: (syscalls that take clone flags as their first
#: argument, syscalls refused with ENOSYS, syscalls refused with EPERM).
_SYSCALLS = {
    "x86_64": {
        0xC000003E: ((56, 272), (435,), (250, 248, 249, 298, 321, 175, 313, 176, 246, 320)),
        0x40000003: ((120, 310), (435,), (288, 286, 287, 336, 357, 128, 350, 129, 283)),  # i386 binaries
    },
    "aarch64": {
        0xC00000B7: ((220, 97), (435,), (219, 217, 218, 241, 280, 105, 273, 106, 104, 294)),
    },
}


def seccomp_program(machine: str | None = None) -> list[tuple[int, int, int, int]] | None:
    """The filter as classic BPF (code, jt, jf, k) instructions; None if this
    machine's architecture is not known here. Any other audit architecture (x32,
    32-bit ARM) gets ENOSYS for every call."""
    tables = _SYSCALLS.get(machine or os.uname().machine)
    if tables is None:
        return None
    # Instructions with symbolic jump targets, resolved below.
    code: list[tuple] = []
    for n, (arch, (flagged, nosys, perm)) in enumerate(tables.items()):
        code.append(("label", f"arch{n}"))
        code.append((_BPF_LD_W_ABS, None, None, 4))  # seccomp_data.arch
        code.append((_BPF_JEQ_K, None, f"arch{n + 1}", arch))
        code.append((_BPF_LD_W_ABS, None, None, 0))  # seccomp_data.nr
        if arch == 0xC000003E:
            code.append((_BPF_JGE_K, "nosys", None, _X32_SYSCALL_BIT))
        code += [(_BPF_JEQ_K, "flags", None, nr) for nr in flagged]
        code += [(_BPF_JEQ_K, "nosys", None, nr) for nr in nosys]
        code += [(_BPF_JEQ_K, "perm", None, nr) for nr in perm]
        code.append((_BPF_RET_K, None, None, _RET_ALLOW))
    code.append(("label", f"arch{len(tables)}"))
    code.append((_BPF_RET_K, None, None, _RET_ERRNO | _ENOSYS))
    code.append(("label", "flags"))
    code.append((_BPF_LD_W_ABS, None, None, 16))  # low word of args[0] (little-endian)
    code.append((_BPF_JSET_K, "perm", None, _CLONE_NEWUSER))
    code.append((_BPF_RET_K, None, None, _RET_ALLOW))
    code.append(("label", "perm"))
    code.append((_BPF_RET_K, None, None, _RET_ERRNO | _EPERM))
    code.append(("label", "nosys"))
    code.append((_BPF_RET_K, None, None, _RET_ERRNO | _ENOSYS))
    labels: dict[str, int] = {}
    body = []
    for insn in code:
        if insn[0] == "label":
            labels[insn[1]] = len(body)
        else:
            body.append(insn)
    program = []
    for pc, (op, jt, jf, k) in enumerate(body):
        jt_off = labels[jt] - pc - 1 if jt else 0
        jf_off = labels[jf] - pc - 1 if jf else 0
        assert 0 <= jt_off < 256 and 0 <= jf_off < 256
        program.append((op, jt_off, jf_off, k))
    return program


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def confine_thread() -> None:
    """Install the commands' seccomp filter on the calling thread (only: no
    TSYNC), so every process it spawns from now on inherits it. Needs root
    (CAP_SYS_ADMIN stands in for no_new_privs, which would be inherited too)."""
    program = seccomp_program()
    if program is None:
        raise SandboxUnavailable(f"no seccomp filter for the {os.uname().machine} architecture: use x86_64 or aarch64")
    filters = (_SockFilter * len(program))(*(_SockFilter(*insn) for insn in program))
    fprog = _SockFprog(len(program), filters)
    arg = ctypes.c_ulong(ctypes.addressof(fprog))
    if _libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), arg, ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise SandboxUnavailable(f"installing the sandbox's seccomp filter failed: {os.strerror(err)}")
