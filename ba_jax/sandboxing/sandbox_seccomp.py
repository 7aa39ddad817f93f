"""Sandbox stage 1 helper: a seccomp filter for the program's process tree. Stdlib only.

`sandbox_launcher` installs it (after no_new_privs, before exec of the harness);
the kernel keeps it across fork and exec, so it binds every process the program
starts. It refuses with EPERM:
  * socket()/socketpair() of any family but AF_UNIX (of any family at all with
    sockets="none"): AF_INET/AF_INET6 would find an empty network namespace, but
    AF_VSOCK (the hypervisor), AF_NETLINK, AF_PACKET, AF_BLUETOOTH... reach
    outside it;
  * memory that is not charged to RLIMIT_AS: memfd_create, memfd_secret and
    SysV shmget (POSIX shared memory needs /dev/shm, absent in the sandbox);
  * new namespaces (unshare, setns, clone with CLONE_NEW*), where a program
    could regain capabilities, mount its own tmpfs or leave the network jail;
  * io_uring, whose operations (sockets, files) bypass seccomp, and a few
    kernel interfaces no program here needs (bpf, userfaultfd, perf events,
    keyrings).
clone3 gets ENOSYS (its flags live in memory a filter cannot read), so libc
falls back to clone, whose flags it can. Other ABIs (i386 `int 0x80`, x32)
are killed or refused: their syscall numbers would dodge the table. Only
x86_64 and aarch64 are supported; elsewhere `install` raises and the sandbox
refuses to run anything.

`signal_program` is a second filter the assertion harness adds once it is set
up, before the program runs: installing a signal handler (rt_sigaction with a
new action) or an alternate signal stack is refused with EPERM; reading either
is not. A handler receives the frame it interrupts, from which a program could
walk to the harness's (see `sandbox_harness`).
"""
import ctypes
import os
import sys

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0 = 0, 4, 16  # args[0]'s low 32 bits (little-endian)
_LD_W_ABS, _JA, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_AF_UNIX = 1
_CLONE_NEW_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_X32_SYSCALL_BIT = 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2

# Syscall numbers differ between architectures (the newer ones, >= 424, are shared).
SYSCALLS = {
    "x86_64": {"audit_arch": 0xC000003E, "socket": 41, "socketpair": 53, "clone": 56,
               "shmget": 29, "memfd_create": 319, "unshare": 272, "setns": 308, "bpf": 321,
               "userfaultfd": 323, "perf_event_open": 298, "add_key": 248,
               "request_key": 249, "keyctl": 250, "pivot_root": 155, "rt_sigaction": 13,
               "sigaltstack": 131},
    "aarch64": {"audit_arch": 0xC00000B7, "socket": 198, "socketpair": 199, "clone": 220,
                "shmget": 194, "memfd_create": 279, "unshare": 97, "setns": 268, "bpf": 280,
                "userfaultfd": 282, "perf_event_open": 241, "add_key": 217,
                "request_key": 218, "keyctl": 219, "pivot_root": 41, "rt_sigaction": 134,
                "sigaltstack": 132},
}
for _table in SYSCALLS.values():
  _table.update(io_uring_setup=425, io_uring_enter=426, io_uring_register=427, clone3=435,
                memfd_secret=447)
REFUSED = ("shmget", "memfd_create", "memfd_secret", "unshare", "setns", "io_uring_setup",
           "io_uring_enter", "io_uring_register", "bpf", "userfaultfd", "perf_event_open",
           "add_key", "request_key", "keyctl")


class Unsupported(Exception):
  pass


def syscalls() -> dict:
  """This process's syscall table; raises `Unsupported` off 64-bit little-endian x86_64/aarch64."""
  machine = os.uname().machine
  machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)
  if machine not in SYSCALLS or ctypes.sizeof(ctypes.c_void_p) != 8 or sys.byteorder != "little":
    raise Unsupported(f"seccomp: the sandbox's filter supports x86_64 and aarch64 (64-bit "
                      f"processes), not {machine} with {8 * ctypes.sizeof(ctypes.c_void_p)}-bit "
                      "pointers")
  return SYSCALLS[machine]


def _stmt(code, k):
  return (code, 0, 0, k)


def _jump(code, k, jt, jf):  # jt/jf: instructions to skip after this one
  return (code, jt, jf, k)


def program(table: dict, sockets: str = "unix") -> list:
  """The filter as (code, jt, jf, k) instructions: a prologue checking the ABI, one JEQ per
  syscall with a rule, then the rules' blocks (the first, "allow", is the fall-through)."""
  if sockets not in ("unix", "none"):
    raise ValueError(f"sockets must be 'unix' or 'none', got {sockets!r}")
  allow, kill = _stmt(_RET_K, _RET_ALLOW), _stmt(_RET_K, _RET_KILL_PROCESS)
  refuse, nosys = _stmt(_RET_K, _RET_ERRNO | _EPERM), _stmt(_RET_K, _RET_ERRNO | _ENOSYS)
  family_is_unix = (_jump(_JEQ_K, _AF_UNIX, 0, 1) if sockets == "unix"
                    else _stmt(_JA, 1))  # "none": straight to refuse
  blocks = {
      "allow": [allow],
      "refuse": [refuse],
      "nosys": [nosys],
      "socket": [_stmt(_LD_W_ABS, _ARG0), family_is_unix, allow, refuse],
      "clone": [_stmt(_LD_W_ABS, _ARG0), _jump(_JSET_K, _CLONE_NEW_FLAGS, 1, 0), allow, refuse],
  }
  checks = [(table[name], "refuse") for name in REFUSED] + [
      (table["clone3"], "nosys"), (table["socket"], "socket"), (table["socketpair"], "socket"),
      (table["clone"], "clone")]
  code = [_stmt(_LD_W_ABS, _ARCH), _jump(_JEQ_K, table["audit_arch"], 1, 0), kill,
          _stmt(_LD_W_ABS, _NR)]
  if table["audit_arch"] == SYSCALLS["x86_64"]["audit_arch"]:
    code += [_jump(_JGE_K, _X32_SYSCALL_BIT, 0, 1), refuse]  # the x32 ABI's numbers
  offsets, position = {}, 0
  for name, block in blocks.items():
    offsets[name] = position
    position += len(block)
  for i, (nr, target) in enumerate(checks):
    code.append(_jump(_JEQ_K, nr, len(checks) - i - 1 + offsets[target], 0))
  for block in blocks.values():
    code.extend(block)
  return code


def _null_argument(index: int) -> list:
  """Allow when the syscall's argument `index` (a pointer) is NULL, else refuse with EPERM."""
  low = _ARG0 + 8 * index
  return [_stmt(_LD_W_ABS, low), _jump(_JEQ_K, 0, 0, 3), _stmt(_LD_W_ABS, low + 4),
          _jump(_JEQ_K, 0, 0, 1), _stmt(_RET_K, _RET_ALLOW), _stmt(_RET_K, _RET_ERRNO | _EPERM)]


def signal_program(table: dict) -> list:
  """The assertion harness's second filter (see the module doc), as (code, jt, jf, k):
  rt_sigaction(signum, act, oldact, size) with act != NULL and sigaltstack(ss, old) with
  ss != NULL are refused."""
  return [_stmt(_LD_W_ABS, _ARCH), _jump(_JEQ_K, table["audit_arch"], 1, 0),
          _stmt(_RET_K, _RET_KILL_PROCESS), _stmt(_LD_W_ABS, _NR),
          _jump(_JEQ_K, table["rt_sigaction"], 2, 0), _jump(_JEQ_K, table["sigaltstack"], 7, 0),
          _stmt(_RET_K, _RET_ALLOW)] + _null_argument(1) + _null_argument(0)


def install(sockets: str = "unix") -> None:
  """Installs the filter on this thread (inherited by every child); raises OSError/Unsupported.
  The assertion harness installs `signal_program` with a copy of this."""
  table = syscalls()
  code = program(table, sockets)

  class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]

  class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

  filters = (SockFilter * len(code))(*[SockFilter(*instruction) for instruction in code])
  fprog = SockFprog(len(code), filters)
  libc = ctypes.CDLL(None, use_errno=True)
  ulong = ctypes.c_ulong
  for result, what in (
      (lambda: libc.prctl(_PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0), ulong(0), ulong(0)),
       "prctl(PR_SET_NO_NEW_PRIVS)"),
      (lambda: libc.prctl(_PR_SET_SECCOMP, ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                          ulong(0), ulong(0)),
       "prctl(PR_SET_SECCOMP) (a kernel without CONFIG_SECCOMP_FILTER?)")):
    if result() != 0:
      errno = ctypes.get_errno()
      raise OSError(errno, f"seccomp: {what}: {os.strerror(errno)}")
