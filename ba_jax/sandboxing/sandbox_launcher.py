"""Sandbox stage 1: namespaces, a new root, limits, then the program. Stdlib only.

`ba_jax.sandboxing.sandbox` starts it as `python -I sandbox_launcher.py CONFIG` in
the run's host dir. It holds no secret and runs no model code:
  1. joins the run's memory cgroup, when the caller made one;
  2. enters new mount, network, PID and IPC namespaces; when not root, inside a
     new user namespace (what an unprivileged user may create);
  3. builds a new root on a tmpfs: read-only binds of the system dirs (/usr,
     /bin, /lib*, /sbin, /etc) and of the interpreter's own dirs, five device
     nodes, an empty read-only /tmp, and /sandbox, a small private tmpfs holding
     the run's files, the one writable place. Nothing else of the host (homes,
     /work, /tmp, /run, /proc, /sys, sockets, other runs) exists in it;
  4. forks the PID namespace's init, which pivots into the new root (keeping a
     handle on a fresh /proc for itself) and forks the program's process:
     rlimits, the fresh uid when root, no_new_privs, the seccomp filter
     (`sandbox_seccomp`), then exec of the harness (`sandbox_harness.py`),
     which holds no capability.
The init ends the whole run at the memory limit: when the run's cgroup OOM-killed
one of its processes, or, without a cgroup, when the memory of the namespace's
processes plus /sandbox, in total, goes over the limit.
The init reports "ready", "memory" (limit exceeded) and the program's exit
status on a status pipe the program never holds. It keeps no signal handler, so
the kernel drops every signal the program sends it (a namespace's init only gets
the signals it handles). The launcher and the init write nothing to the run's
stderr (only the program does), and both die with their parent: a caller killed
mid-run leaves no process behind. A setup failure is reported
there as "error: ..." (the kernel refused: nothing can run) or "reject: ..."
(this sample cannot run, e.g. its files do not fit /sandbox).
"""
import ctypes
import errno
import json
import os
import resource
import signal
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's dir out
import sandbox_seccomp  # noqa: E402 -- a sibling file, found through the line above

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = -100, 0x8000, 442  # 442 on every architecture
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
INSIDE = "/sandbox"  # the program's work dir, HOME and TMPDIR
WATCH_INTERVAL_S = 0.01

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
  pass


class Rejected(Exception):
  """This sample cannot run (not the kernel's refusal)."""


class MountAttr(ctypes.Structure):
  _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
              ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result, what):
  if result != 0:
    raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _bytes(value):
  return None if value is None else os.fsencode(value)


def mount(source, target, fstype, flags, data=None):
  _check(libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags),
                    _bytes(data)), f"mount {fstype or source} on {target}")


def set_mount_attr(path, attr_set, recursive):
  attr = MountAttr(attr_set, 0, 0, 0)
  flags = AT_RECURSIVE if recursive else 0
  _check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(AT_FDCWD),
                      ctypes.c_char_p(os.fsencode(path)), ctypes.c_long(flags),
                      ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr))),
         f"mount_setattr {path} (needs Linux >= 5.12)")


def prctl(option, value):
  _check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def join_cgroup(procs_file):
  try:
    with open(procs_file, "w") as f:
      f.write(str(os.getpid()))
  except OSError as e:
    raise SetupError(f"joining the run's memory cgroup {procs_file}: {e.strerror}") from None


def enter_namespaces(as_root):
  flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
  if not as_root:
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | flags), "unshare(user, mount, network, pid, ipc) "
           "(unprivileged user namespaces disabled? see user.max_user_namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  else:
    _check(libc.unshare(flags), "unshare(mount, network, pid, ipc)")


def _under(path, directories):
  return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)


def interpreter_dirs():
  """The dirs this interpreter (the harness's) needs outside the system dirs: its standard
  library, site-packages, binary and shared library, and a venv's root."""
  paths = sysconfig.get_paths()
  wanted = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
  wanted += [os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
  if sysconfig.get_config_var("Py_ENABLE_SHARED"):
    wanted.append(sysconfig.get_config_var("LIBDIR"))
  if sys.prefix != sys.base_prefix:
    wanted.append(sys.prefix)  # a venv: pyvenv.cfg sits at its root
  found = set()
  for path in filter(None, wanted):
    for variant in (os.path.abspath(path), os.path.realpath(path)):
      if os.path.isdir(variant) and variant != "/" and not _under(variant, SYSTEM_DIRS):
        found.add(variant)
  return sorted(d for d in found if not _under(d, found - {d}))  # outermost only


def _bind_read_only(source, target, recursive=True, nodev=True):
  mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
  set_mount_attr(target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (MOUNT_ATTR_NODEV if nodev else 0),
                 recursive=recursive)


def build_root(root, files, cfg):
  """The new root, on a tmpfs mounted over the run's host dir (see the module doc)."""
  mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the caller's mounts
  mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
  for directory in SYSTEM_DIRS:
    if os.path.islink(directory):  # merged /usr: /bin -> usr/bin
      os.symlink(os.readlink(directory), root + directory)
    elif os.path.isdir(directory):
      os.makedirs(root + directory)
      _bind_read_only(directory, root + directory)
  for directory in interpreter_dirs():
    os.makedirs(root + directory, exist_ok=True)
    _bind_read_only(directory, root + directory)
  os.makedirs(root + "/dev")
  for name in DEVICES:
    if os.path.exists("/dev/" + name):
      open(f"{root}/dev/{name}", "w").close()
      _bind_read_only("/dev/" + name, f"{root}/dev/{name}", recursive=False, nodev=False)
  for directory in ("/proc", "/tmp", INSIDE):
    os.makedirs(root + directory, exist_ok=True)  # an interpreter under /tmp made it already
  owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
  mount("tmpfs", root + INSIDE, "tmpfs", MS_NOSUID | MS_NODEV,
        f"size={cfg['workdir_bytes']},nr_inodes=4096,mode=0700{owner}")
  for name, content in files.items():
    path = os.path.join(root + INSIDE, name)
    try:
      with open(path, "wb") as f:
        f.write(content)
    except OSError as e:
      if e.errno in (errno.ENOSPC, errno.EFBIG):
        raise Rejected(f"the program and its test files ({sum(map(len, files.values()))} "
                       f"bytes) do not fit the work directory ({cfg['workdir_bytes']} bytes)")
      raise
    os.chmod(path, 0o644)


def enter_root(root) -> int:
  """In the init (PID 1 of the new namespace): the new root replaces /; returns a handle on a
  fresh /proc of the namespace that only the init holds (the program sees no /proc at all)."""
  mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  os.chdir(root)
  table = sandbox_seccomp.syscalls()
  _check(libc.syscall(ctypes.c_long(table["pivot_root"]), ctypes.c_char_p(b"."),
                      ctypes.c_char_p(b".")), "pivot_root")
  _check(libc.umount2(ctypes.c_char_p(b"."), ctypes.c_int(MNT_DETACH)), "umount2 old root")
  os.chdir("/")
  proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  _check(libc.umount2(ctypes.c_char_p(b"/proc"), ctypes.c_int(MNT_DETACH)), "umount2 /proc")
  os.rmdir("/proc")
  set_mount_attr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
  os.chdir(INSIDE)
  return proc


def limit(kind, value):
  try:
    resource.setrlimit(kind, (value, value))
  except (ValueError, OSError):
    pass


def start_program(cfg, status_fd, stderr_fd):
  """The program's process: limits, identity, seccomp, then exec of the harness (never returns)."""
  try:
    os.dup2(stderr_fd, 2)  # the run's stderr, which only the program writes to
    os.close(stderr_fd)
    limit(resource.RLIMIT_CPU, cfg["cpu_s"])
    limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NPROC, cfg["nproc"])
    limit(resource.RLIMIT_MSGQUEUE, 0)  # POSIX message queues are kernel memory
    if cfg["uid"] is not None:
      os.setgroups([])
      os.setgid(cfg["uid"])
      os.setuid(cfg["uid"])
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    for fd in (cfg["harness"]["token_fd"], cfg["harness"]["result_fd"]):
      os.set_inheritable(fd, fd in cfg["program_fds"])  # what this run's mode needs, only
    sandbox_seccomp.install(cfg["sockets"])  # last: it refuses what the steps above need
    os.write(status_fd, b"ready\n")
    python = cfg["python"]
    os.execv(python, [python, "-I", "harness.py", json.dumps(cfg["harness"])])
  except BaseException as e:  # noqa: BLE001 -- reported on the status pipe, then exit
    os.write(status_fd, f"error: could not start the program: {type(e).__name__}: {e}\n".encode())
  os._exit(125)


def memory_in_use(proc) -> int:
  """Bytes held by the namespace's processes (anonymous and shared pages, each process counted
  in full) plus the files in /sandbox; the init itself is left out. `proc`: a /proc dir fd."""
  total = 0
  for entry in os.listdir(proc):
    if not entry.isdigit() or entry == "1":
      continue
    try:
      fd = os.open(f"{entry}/status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
      with open(fd, "rb") as f:
        for line in f:
          if line.startswith((b"RssAnon:", b"RssShmem:")):
            total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
      continue
  usage = os.statvfs(INSIDE)
  return total + (usage.f_blocks - usage.f_bfree) * usage.f_frsize


def oom_killed(events) -> bool:
  """Whether the run's cgroup OOM-killed a process (`events`: its memory.events (v2) or
  memory.oom_control (v1), opened before the namespaces)."""
  for line in os.pread(events, 4096, 0).splitlines():
    key, _, value = line.partition(b" ")
    if key == b"oom_kill" and value.strip().isdigit() and int(value) > 0:
      return True
  return False


def run_init(cfg, status_fd, root, events, stderr_fd):
  """PID 1 of the run's namespace: starts the program, reaps, reports its status (never returns).

  It ends the whole run at the memory limit: when the cgroup killed one of its processes, or
  (without a cgroup) when the watchdog finds the total over the limit. When it exits the
  kernel kills every process left in the namespace."""
  try:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_DUMPABLE, 0)
    proc = enter_root(root)
  except (SetupError, OSError, sandbox_seccomp.Unsupported) as e:
    os.write(status_fd, f"error: {e}\n".encode())
    os._exit(125)
  program = os.fork()
  if program == 0:
    os.close(proc)
    if events is not None:
      os.close(events)
    start_program(cfg, status_fd, stderr_fd)
  os.close(stderr_fd)
  for number in signal.valid_signals():  # no handler: the kernel drops the program's signals
    try:
      if callable(signal.getsignal(number)):
        signal.signal(number, signal.SIG_DFL)
    except (ValueError, OSError):
      pass
  watch = cfg["watchdog_bytes"]
  watching = events is not None or watch is not None
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # woken by sigtimedwait
  while True:
    try:
      pid, wait_status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      os._exit(125)
    if pid == program:
      break
    if pid:
      continue  # an orphan of the program, reaped
    if watching and (oom_killed(events) if events is not None else memory_in_use(proc) > watch):
      os.write(status_fd, b"memory\n")
      os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
      watching = False
    signal.sigtimedwait({signal.SIGCHLD}, WATCH_INTERVAL_S)
  if os.WIFSIGNALED(wait_status):
    os.write(status_fd, f"signal {os.WTERMSIG(wait_status)}\n".encode())
  else:
    os.write(status_fd, f"exit {os.WEXITSTATUS(wait_status)}\n".encode())
  os._exit(0)


def die_with_caller(caller_pid):
  """SIGKILL when the caller dies (its thread that started this process, in fact)."""
  prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != caller_pid:  # it died before the line above
    os._exit(125)


def main():
  cfg = json.loads(sys.argv[1])
  die_with_caller(cfg["caller_pid"])
  # The run's stderr is the program's: nothing of the launcher's (host paths) goes there.
  stderr_fd = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)
  status_fd = cfg["status_fd"]
  os.set_inheritable(status_fd, False)  # the program never holds it
  root = os.getcwd()
  files = {}
  for name in cfg["files"]:
    with open(os.path.join(root, name), "rb") as f:
      files[name] = f.read()
  events = None
  try:
    if cfg["cgroup_procs"]:
      join_cgroup(cfg["cgroup_procs"])
      events = os.open(cfg["cgroup_events"], os.O_RDONLY | os.O_CLOEXEC)
    enter_namespaces(cfg["uid"] is not None)
    die_with_caller(cfg["caller_pid"])  # a credential change may have cleared it
    build_root(root, files, cfg)
  except Rejected as e:
    os.write(status_fd, f"reject: {e}\n".encode())
    os._exit(125)
  except (SetupError, OSError) as e:
    os.write(status_fd, f"error: {e}\n".encode())
    os._exit(125)
  del files
  init = os.fork()
  if init == 0:
    run_init(cfg, status_fd, root, events, stderr_fd)
  os.waitpid(init, 0)
  os._exit(0)


if __name__ == "__main__":
  main()
