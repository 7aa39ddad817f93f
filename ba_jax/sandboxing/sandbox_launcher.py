"""Sandbox stage 1: namespaces, a read-only file system, then the program. Stdlib only.

`ba_jax.sandboxing.sandbox` copies this file into the run's temp dir and starts it as
`python -I launcher.py CONFIG`. It holds no secret and runs no model code:
  1. enters new mount, network, PID and IPC namespaces; when not root, inside a
     new user namespace (what an unprivileged user may create);
  2. makes every mount read-only, nosuid and nodev, hides /tmp, /var/tmp,
     /dev/shm and /run behind empty tmpfs (read-only too) and mounts a small
     private tmpfs on the run's dir, the one writable place, gone with the run;
  3. forks the PID namespace's init, which mounts a fresh /proc (the caller's
     processes are neither visible nor addressable) and forks the program's
     process: rlimits, the fresh uid when root, no_new_privs, then exec of the
     harness (`sandbox_harness.py`), which drops every capability.
The init reports "ready", then the program's exit status, on a status pipe the
program never holds; a setup failure is reported there as "error: ...".
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = -100, 0x8000, 442  # 442 on every architecture
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
MASKED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
  pass


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


def isolate_filesystem(workdir, files, cfg):
  mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the caller's mounts
  set_mount_attr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=True)
  masked = [d for d in MASKED_DIRS if os.path.isdir(d) and not os.path.islink(d)]
  for directory in masked:  # sockets and other runs' files live here
    mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
  os.makedirs(workdir, exist_ok=True)  # recreated if it was under a masked dir
  owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
  mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
        f"size={cfg['workdir_bytes']},nr_inodes=4096,mode=0700{owner}")
  for name, content in files.items():
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
      f.write(content)
    os.chmod(path, 0o644)
  for directory in masked:
    set_mount_attr(directory, MOUNT_ATTR_RDONLY, recursive=False)


def limit(kind, value):
  try:
    resource.setrlimit(kind, (value, value))
  except (ValueError, OSError):
    pass


def start_program(cfg, status_fd):
  """The program's process: limits, identity, then exec of the harness (never returns)."""
  try:
    limit(resource.RLIMIT_CPU, cfg["cpu_s"])
    limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NPROC, cfg["nproc"])
    if cfg["uid"] is not None:
      os.setgroups([])
      os.setgid(cfg["uid"])
      os.setuid(cfg["uid"])
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    for fd in cfg["program_fds"]:
      os.set_inheritable(fd, True)
    os.write(status_fd, b"ready\n")
    python = cfg["python"]
    os.execv(python, [python, "-I", "harness.py", json.dumps(cfg["harness"])])
  except BaseException as e:  # noqa: BLE001 -- reported on the status pipe, then exit
    os.write(status_fd, f"error: could not start the program: {type(e).__name__}: {e}\n".encode())
  os._exit(125)


def run_init(cfg, status_fd):
  """PID 1 of the run's namespace: starts the program, reaps, reports its status (never returns).

  When it exits the kernel kills every process left in the namespace."""
  try:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_DUMPABLE, 0)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  except (SetupError, OSError) as e:
    os.write(status_fd, f"error: {e}\n".encode())
    os._exit(125)
  program = os.fork()
  if program == 0:
    start_program(cfg, status_fd)
  while True:
    try:
      pid, wait_status = os.waitpid(-1, 0)
    except ChildProcessError:
      os._exit(125)
    if pid == program:
      break
  if os.WIFSIGNALED(wait_status):
    os.write(status_fd, f"signal {os.WTERMSIG(wait_status)}\n".encode())
  else:
    os.write(status_fd, f"exit {os.WEXITSTATUS(wait_status)}\n".encode())
  os._exit(0)


def main():
  cfg = json.loads(sys.argv[1])
  status_fd = cfg["status_fd"]
  os.set_inheritable(status_fd, False)  # the program never holds it
  workdir = os.getcwd()
  files = {}
  for name in cfg["files"]:
    with open(os.path.join(workdir, name), "rb") as f:
      files[name] = f.read()
  try:
    enter_namespaces(cfg["uid"] is not None)
    isolate_filesystem(workdir, files, cfg)
    os.chdir(workdir)  # the cwd still pointed at the directory under the new tmpfs
  except (SetupError, OSError) as e:
    os.write(status_fd, f"error: {e}\n".encode())
    os._exit(125)
  init = os.fork()
  if init == 0:
    run_init(cfg, status_fd)
  os.waitpid(init, 0)
  os._exit(0)


if __name__ == "__main__":
  main()
