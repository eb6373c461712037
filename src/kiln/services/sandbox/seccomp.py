"""The syscall filter of the bubblewrap backend: a deny-list in the Docker/containerd style.

The sandbox runs the model's own code on the node's kernel, so the kernel interfaces that
ordinary tool use (shells, compilers, git, python, pytest) never needs, and that keep turning
up in container escapes, are refused with EPERM:

- new namespaces: `unshare`, `setns`, and `clone` with any CLONE_NEW* flag (a nested user
  namespace would hand the code a full capability set over its own mounts and network);
  `clone3` gets ENOSYS, as in Docker's profile, because its flags sit in a struct seccomp cannot
  read: libc then falls back to `clone`, whose flags are checked;
- io_uring, kernel keyrings, eBPF, perf events, userfaultfd;
- kexec, reboot, kernel modules, mounts (old and new API), swap, accounting, quotas, file
  handles, the clocks, I/O ports, `syslog` and a few obsolete calls.

`ptrace`, `process_vm_readv/writev` and `kcmp` stay allowed (debuggers and `strace` work): as
in Docker's profile on kernels >= 4.8, the PID namespace confines them, since no process of
another sandbox or of the host can be named from inside one.

The program is compiled by libseccomp (through ctypes; Debian's `libseccomp2`, a dependency
of apt, so present in every Debian-based image), which knows each architecture's syscall
numbers and emits the architecture check: a syscall made under any other ABI (i386 via
`int 0x80`, x32 on x86_64) kills the process. A hand-written assembler would need its own
syscall tables per architecture; that is exactly what libseccomp maintains.

Not covered: filtering by path or address (seccomp cannot read pointers; the mount namespace
and the network namespace do that). bwrap loads the filter into sandboxed commands
(`--seccomp FD`, right before it execs them); a plugin worker loads it into itself (`load`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from .interface import SandboxError

#: Syscalls refused with EPERM whatever their arguments.
DENIED = (
    # namespaces
    "unshare", "setns",
    # io_uring: a second syscall interface that bypasses per-syscall filtering
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # kernel keyrings, eBPF, perf, userfaultfd
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    # the machine itself
    "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module",
    "create_module", "query_module", "get_kernel_syms", "swapon", "swapoff", "acct",
    "quotactl", "quotactl_fd", "syslog", "settimeofday", "stime", "clock_settime",
    "clock_adjtime", "adjtimex", "ioperm", "iopl", "vm86", "vm86old", "lookup_dcookie",
    "nfsservctl", "sysfs", "_sysctl", "uselib", "ustat",
    # mounts, old and new API
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
    "open_tree", "move_mount", "mount_setattr",
    # file handles (open_by_handle_at walked out of Docker containers: "shocker")
    "open_by_handle_at", "name_to_handle_at",
)

#: Flags refused in `clone`'s first argument (each a rule of its own: rules on one syscall OR).
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# libseccomp's ABI (seccomp.h).
_ACT_ALLOW = 0x7FFF0000
_ACT_KILL_PROCESS = 0x80000000
_FLTATR_ACT_BADARCH = 2
_FLTATR_CTL_TSYNC = 4
_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SandboxError(f"libseccomp not found ({exc}): install libseccomp2 for the "
                           "bubblewrap backend's syscall filter") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_pfc.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise SandboxError(f"libseccomp: {what} failed: {os.strerror(-rc)}")


def _build(export: str) -> bytes:
    lib = _lib()
    ctx = _context(lib)
    try:
        read, write = os.pipe()
        try:
            # The program is a few hundred bytes: far below a pipe's buffer, so the write
            # end can be filled before anything reads.
            exporter = lib.seccomp_export_bpf if export == "bpf" else lib.seccomp_export_pfc
            _check(exporter(ctx, write), f"export_{export}")
            os.close(write)
            write = -1
            chunks = []
            while chunk := os.read(read, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
    finally:
        lib.seccomp_release(ctx)


def _context(lib: ctypes.CDLL) -> int:
    """A libseccomp filter context holding the deny-list (the caller releases it)."""
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SandboxError("libseccomp: seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _FLTATR_ACT_BADARCH, _ACT_KILL_PROCESS), "attr_set")
        # Every thread of the caller (a Python process may already run some) gets the filter.
        _check(lib.seccomp_attr_set(ctx, _FLTATR_CTL_TSYNC, 1), "attr_set tsync")
        eperm = _act_errno(errno.EPERM)
        for name in DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall of this architecture (vm86 on x86_64, ...)
            _check(lib.seccomp_rule_add_array(ctx, eperm, nr, 0, None), f"rule {name}")
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        for flag in CLONE_NAMESPACE_FLAGS.values():
            cmp = _ArgCmp(0, _CMP_MASKED_EQ, flag, flag)
            _check(lib.seccomp_rule_add_array(ctx, eperm, clone, 1, ctypes.byref(cmp)),
                   "rule clone")
        clone3 = lib.seccomp_syscall_resolve_name(b"clone3")
        if clone3 >= 0:
            _check(lib.seccomp_rule_add_array(ctx, _act_errno(errno.ENOSYS), clone3, 0, None),
                   "rule clone3")
    except BaseException:
        lib.seccomp_release(ctx)
        raise
    return ctx


def load() -> None:
    """Put the filter on the calling process itself, for good (with no_new_privs, which
    libseccomp sets first): what a plugin worker does before it imports any plugin code."""
    lib = _lib()
    ctx = _context(lib)
    try:
        _check(lib.seccomp_load(ctx), "load")
    finally:
        lib.seccomp_release(ctx)


@functools.cache
def program() -> bytes:
    """The filter as raw classic BPF (`struct sock_filter[]`), what `bwrap --seccomp` reads."""
    return _build("bpf")


def describe() -> str:
    """The filter in libseccomp's readable pseudo-code (for reviews and `kiln sandbox`)."""
    return _build("pfc").decode()


def program_fd() -> int:
    """A pipe's read end holding the program, for one bwrap (it reads to EOF); the caller
    passes it with `pass_fds` and closes it after the spawn."""
    data = program()
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return read
