"""The sandbox launcher: started as ``python -I -S -B sandbox_launcher.py <json>``.

Standard library only (it runs before, and outside, the project's environment). It joins
the pids cgroup, enters new namespaces, confines the file system, forks the program's
process, drops its capabilities, sets its rlimits and execs the interpreter with the
prelude; see :mod:`lopd_jax.envs.code.sandbox` for the layers and what each enforces. It
reports the layers in force and the program's exit status as ``REPORT_PREFIX`` + JSON
lines on the inherited ``report_fd``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

REPORT_PREFIX = "LOPD_SANDBOX_REPORT "


_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_MOUNT_OPTS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
               "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
               "relatime": _MS_RELATIME, "strictatime": _MS_STRICTATIME}

# Runs inside the sandboxed interpreter before the program (argv: workdir, block_net).
_PRELUDE = r"""
import os, sys
_root = os.path.realpath(sys.argv[1])
_block_net = sys.argv[2] == "1"
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_OK_DEV = ("/dev/null", "/dev/zero", "/dev/stdout", "/dev/stderr")
def _hook(event, args, _rp=os.path.realpath, _sep=os.sep, _root=_root, _block_net=_block_net):
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int) or path is None:
            return
        writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                   else bool((flags or 0) & _WRITE))
        if writing:
            p = _rp(os.fsdecode(path))
            if p != _root and not p.startswith(_root + _sep) and p not in _OK_DEV:
                raise PermissionError(f"sandbox: writing outside {_root} is not allowed: {p}")
    elif _block_net and event in ("socket.__new__", "socket.connect", "socket.bind"):
        raise PermissionError("sandbox: network access is disabled")
sys.addaudithook(_hook)
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _src = _f.read()
_g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
del _f, _hook
exec(compile(_src, "main.py", "exec"), _g)
"""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(libc, enforced: dict) -> bool:
    """Enter new namespaces (directly as root, else via a user namespace)."""
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if libc.unshare(flags) == 0:
        enforced["user_namespace"] = False
        return True
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags | _CLONE_NEWUSER) != 0:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            if name != "setgroups":
                raise
    enforced["user_namespace"] = True
    return True


def _mount_points() -> list[tuple[str, int]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" - ")[0].split()
            point = fields[4].encode().decode("unicode_escape")  # \040 for spaces
            flags = 0
            for opt in fields[5].split(","):
                flags |= _MOUNT_OPTS.get(opt, 0)
            out.append((point, flags))
    return out


def _confine_filesystem(libc, workdir: str, enforced: dict, hidden: list) -> None:
    """Inside the new mount namespace: everything read-only but ``workdir``; ``hidden``
    paths covered (an empty read-only tmpfs on a directory, ``/dev/null`` on a file);
    fresh /proc."""
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    wd = workdir.encode()
    _check(libc.mount(wd, wd, None, _MS_BIND, None), "bind workdir")
    all_ro = True
    for point, flags in _mount_points():
        if point == workdir:
            continue
        p = point.encode()
        if libc.mount(None, p, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | flags, None) != 0:
            all_ro = all_ro and not os.path.exists(point)
    enforced["readonly_mounts"] = all_ro
    hidden_ok = True
    for path in hidden:  # answers the program must not read: empty tmpfs / null file on top
        p = path.encode()
        if os.path.isdir(path):
            ret = libc.mount(b"tmpfs", p, b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV
                             | _MS_NOEXEC, b"size=4k,mode=555")
        elif os.path.exists(path):
            ret = libc.mount(b"/dev/null", p, None, _MS_BIND, None)
            if ret == 0:
                ret = libc.mount(None, p, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)
        else:
            continue
        hidden_ok = hidden_ok and ret == 0
    enforced["hidden_paths"] = hidden_ok
    os.chdir(workdir)  # the old cwd is the directory under the bind mount, not on it
    proc_flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY
    enforced["private_proc"] = libc.mount(b"proc", b"/proc", b"proc", proc_flags, None) == 0


def _drop_capabilities(libc) -> bool:
    """Empty the bounding/ambient/effective/permitted sets and lock root's privileges out."""

    pr_set_no_new_privs, pr_capbset_drop, pr_set_securebits, pr_cap_ambient = 38, 24, 28, 47
    libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0)
    # SECBIT_NOROOT, _LOCKED, NO_SETUID_FIXUP, _LOCKED, KEEP_CAPS_LOCKED,
    # NO_CAP_AMBIENT_RAISE, _LOCKED: uid 0 gains nothing at exec.
    securebits = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80
    libc.prctl(pr_set_securebits, securebits, 0, 0, 0)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        libc.prctl(pr_capbset_drop, cap, 0, 0, 0)
    libc.prctl(pr_cap_ambient, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        return False
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return int(status.get("CapEff", "1").strip(), 16) == 0 and int(
        status.get("CapBnd", "1").strip(), 16) == 0


def _set_rlimits(conf: dict) -> None:
    def lim(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    lim(resource.RLIMIT_CPU, conf["cpu_s"], conf["cpu_s"] + 1)
    lim(resource.RLIMIT_AS, conf["memory"])
    lim(resource.RLIMIT_FSIZE, conf["fsize"])
    lim(resource.RLIMIT_CORE, 0)
    # Counted per real uid (uid 0 is exempt): allow what the user already runs.
    lim(resource.RLIMIT_NPROC, conf["nproc"] + conf.get("uid_procs", 0))


def _count_own_processes() -> int:
    """Processes of this real uid on the host (read before a private /proc is mounted)."""
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


def _exec_program(conf: dict, libc, enforced: dict, caps_w: int) -> None:
    """In the forked child: limits, capabilities, then exec the interpreter + prelude."""
    try:
        os.close(conf["report_fd"])
        os.write(caps_w, b"1" if _drop_capabilities(libc) else b"0")
        os.close(caps_w)
        _set_rlimits(conf)
        block_net = "0" if enforced.get("network_namespace") else "1"
        os.execv(conf["python"], [conf["python"], "-I", "-B", "-c", _PRELUDE,
                                  conf["workdir"], block_net])
    except BaseException as e:  # exec failed: say why on stderr, exit non-zero
        os.write(2, f"sandbox: cannot start the program: {e!r}\n".encode())
    os._exit(127)


def _supervise(conf: dict, libc, enforced: dict) -> int:
    """Fork the program, wait for it, report its status on the report fd."""
    caps_r, caps_w = os.pipe()  # close-on-exec: the program never holds it
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot open our fds via /proc
    pid = os.fork()
    if pid == 0:
        os.close(caps_r)
        _exec_program(conf, libc, enforced, caps_w)
    os.close(caps_w)
    enforced["capabilities_dropped"] = os.read(caps_r, 1) == b"1"  # b"" if it died first
    os.close(caps_r)
    started = {"enforced": enforced}  # already known if the parent kills us later
    os.write(conf["report_fd"], (REPORT_PREFIX + json.dumps(started) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    report = {"returncode": rc, "enforced": enforced}
    os.write(conf["report_fd"], (REPORT_PREFIX + json.dumps(report) + "\n").encode())
    return 0


def _join_cgroup(path: str) -> bool:
    """Move this process into the cgroup at ``path``; False when the kernel refuses."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return True
    except OSError:
        return False


def _launcher_main(conf: dict) -> int:
    """Apply the isolation layers, then supervise the program (see the module docstring)."""
    libc = _libc()
    enforced = {"network_namespace": False, "pid_namespace": False, "readonly_mounts": False,
                "private_proc": False, "cgroup_joined": False,
                "hidden_paths": not conf.get("hidden")}
    for key in ("cgroup", "memory_cgroup"):  # enforced["<key>_joined"]: whether this process joined
        if conf.get(key) and _join_cgroup(conf[key]):
            enforced[f"{key}_joined"] = True
    if os.getuid() != 0:
        conf["uid_procs"] = _count_own_processes()
    in_ns = False
    if conf["namespaces"]:
        try:
            in_ns = _unshare(libc, enforced)
        except OSError:
            in_ns = False
    if not in_ns:
        return _supervise(conf, libc, enforced)
    init = os.fork()  # first child is pid 1 of the new PID namespace
    if init:
        _, status = os.waitpid(init, 0)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    try:
        enforced["network_namespace"] = enforced["pid_namespace"] = True
        try:
            _confine_filesystem(libc, conf["workdir"], enforced, conf.get("hidden", []))
        except OSError:  # recorded as readonly_mounts/private_proc = False
            pass
        os._exit(_supervise(conf, libc, enforced))
    except BaseException as e:
        os.write(conf["report_fd"], (REPORT_PREFIX + json.dumps(
            {"setup_error": repr(e), "enforced": enforced}) + "\n").encode())
        os._exit(1)


if __name__ == "__main__":
    sys.exit(_launcher_main(json.loads(sys.argv[1])))
