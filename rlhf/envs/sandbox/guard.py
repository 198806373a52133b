"""The sandboxed interpreter's first code: the guard, then ``main.py`` run as ``__main__``.

Run as ``python -I -S -B -X utf8 -c <this file's text> ROOT READY`` by the launcher (launch.py), in
a fresh interpreter whose limits, namespaces and identity the launcher set before its ``exec``:
nothing the setup needed (ctypes above all) exists in this process. Standard library only; it must
not import ``rlhf``.

The guard is a Python audit hook. Under kernel isolation it is the second layer, which turns what
the kernel would refuse anyway into one clear line for the policy; without isolation (the ``guard``
mode) it is the only one. It refuses, with ``PermissionError("sandbox: ... is not allowed")``:
sockets, opening files for writing and other changes outside ROOT, starting processes, signals to
other processes, ctypes, subinterpreters, changing resource limits, and changing its own functions.
``_posixsubprocess.fork_exec`` (which raises no audit event) is replaced.
"""

import posix
import sys


def inside(
    path,
    # set below (a default: not reachable from the user's code)
    _root=None,
    _open_ok=frozenset(("/dev/null", "/dev/stdout", "/dev/stderr")),
    _lstat=posix.lstat,
    _readlink=posix.readlink,
    _getcwd=posix.getcwd,
    _fspath=posix.fspath,
    _item=tuple.__getitem__,
    _isinstance=isinstance,
    _bytes=bytes,
    _str=str,
    _list=list,
    _reversed=reversed,
    _OSError=OSError,
):
    """Whether path, symlinks resolved, lies in the root. The primitives are bound as defaults (a
    tuple: not writable from the user's code), so patching os.path, os.stat_result or builtins
    cannot change the answer."""
    path = _fspath(path)
    if _isinstance(path, _bytes):
        path = _bytes.decode(path, "utf-8", "surrogateescape")
    # an exact str: no overridden methods of a subclass
    path = _str.__add__("", path)
    if path in _open_ok:
        return True
    if not path.startswith("/"):
        path = _getcwd() + "/" + path
    todo = _list(_reversed(path.split("/")))
    done = []
    hops = 0
    while todo:
        name = todo.pop()
        if name == "" or name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = "/" + "/".join(done + [name])
        try:
            mode = _item(_lstat(here), 0)
        except _OSError:
            done.append(name)
            continue
        if mode & 0o170000 == 0o120000:
            hops += 1
            if hops > 40:
                return False
            target = _readlink(here)
            if target.startswith("/"):
                done = []
            todo.extend(_reversed(target.split("/")))
            continue
        done.append(name)
    resolved = "/" + "/".join(done)
    return resolved == _root or resolved.startswith(_root + "/")


# event, positions of its paths, positions of its dir_fd arguments
PATH_EVENTS = (
    ("os.mkdir", (0,), (2,)),
    ("os.rmdir", (0,), (1,)),
    ("os.remove", (0,), (1,)),
    ("os.rename", (0, 1), (2, 3)),
    # a hard link inside to a file outside would write through
    ("os.link", (0, 1), (2, 3)),
    ("os.symlink", (1,), (2,)),
    ("os.chmod", (0,), (2,)),
    ("os.chown", (0,), (3,)),
    ("os.utime", (0,), (3,)),
    ("os.truncate", (0,), ()),
    ("os.setxattr", (0,), ()),
    ("os.removexattr", (0,), ()),
    ("os.chflags", (0,), ()),
    ("os.lchflags", (0,), ()),
    ("shutil.rmtree", (0,), ()),
)
PROCESS_EVENTS = (
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "pty.spawn",
    "os.startfile",
)
REFUSED_MODULES = (
    ("ctypes", "native code (ctypes)"),
    ("_ctypes", "native code (ctypes)"),
    ("_posixsubprocess", "starting processes"),
    ("_xxsubinterpreters", "a subinterpreter"),
    ("_xxinterpchannels", "a subinterpreter"),
    ("_interpreters", "a subinterpreter"),  # Python >= 3.13's names
    ("_interpchannels", "a subinterpreter"),
    ("_interpqueues", "a subinterpreter"),
)


def guard(
    event,
    args,
    _inside=inside,
    # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND
    _write=0o1 | 0o2 | 0o100 | 0o1000 | 0o2000,
    _paths=PATH_EVENTS,
    _path_events=frozenset(name for name, _, _ in PATH_EVENTS),
    _process_events=frozenset(PROCESS_EVENTS),
    _no_dir_fd=(None, -1, -100),
    _modules=REFUSED_MODULES,
    _code_attributes=frozenset(("__code__", "__defaults__", "__kwdefaults__")),
    _protected=(),  # (guard, inside), set below
    _getpid=posix.getpid,
    _getpgrp=posix.getpgrp,
    _isinstance=isinstance,
    _len=len,
    _int=int,
    _str=str,
    _PermissionError=PermissionError,
):
    what = None
    if event == "open":
        path, mode, flags = (args + (None, None, None))[:3]
        if _isinstance(flags, _int):
            writes = flags & _write
        else:
            writes = mode is None or not _isinstance(mode, _str) or mode.strip("rbt") != ""
        if writes and not _isinstance(path, _int) and not _inside(path):
            what = "writing outside the working directory"
    elif event in _path_events:
        for name, paths, dir_fds in _paths:
            if name != event:
                continue
            for i in dir_fds:
                if i < _len(args) and args[i] not in _no_dir_fd:
                    what = "a dir_fd argument"
            for i in paths:
                if i >= _len(args) or (event == "os.truncate" and _isinstance(args[i], _int)):
                    # truncating a file opened for writing: the open was checked
                    continue
                if _isinstance(args[i], _int) or not _inside(args[i]):
                    what = "changing files outside the working directory"
    elif event in _process_events:
        what = "starting processes"
    elif event.startswith("socket."):
        what = "network access"
    elif event.startswith("ctypes."):
        what = "native code (ctypes)"
    elif event == "import":
        for name, why in _modules:
            if args[0] == name:
                what = why
    elif event == "cpython.PyInterpreterState_New":
        what = "a subinterpreter"
    elif event == "os.kill":
        if args[0] != _getpid() and args[0] != 0:
            what = "signalling other processes"
    elif event == "os.killpg":
        if args[0] != _getpgrp():
            what = "signalling other processes"
    elif event == "resource.setrlimit" or (event == "resource.prlimit" and args[2] is not None):
        what = "changing resource limits"
    elif event == "object.__setattr__" and args[1] in _code_attributes:
        for f in _protected:
            if args[0] is f:
                what = "changing the sandbox's guard"
    if what is not None:
        raise _PermissionError("sandbox: " + what + " is not allowed")


def no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")


def install(root):
    """The guard bound to ``root`` (its defaults, which the user's code cannot reach) and hooked
    in."""
    import _posixsubprocess

    # the one way to a process that raises no audit event
    _posixsubprocess.fork_exec = no_fork_exec
    for f, name, value in ((inside, "_root", root), (guard, "_protected", (guard, inside))):
        defaults = list(f.__defaults__)
        # the position of the first argument with a default
        first = f.__code__.co_argcount - len(defaults)
        defaults[f.__code__.co_varnames.index(name) - first] = value
        f.__defaults__ = tuple(defaults)
    sys.addaudithook(guard)


def run_main(ready):
    """main.py compiled as "main.py" (tracebacks name no path) and run as __main__, after saying on
    the fd ``ready`` that the setup worked (a failure before it is the sandbox's, not the
    code's)."""
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    sys.argv[:] = ["main.py"]
    with open("main.py", "rb") as f:
        source = f.read()
    try:
        # as the trainer wrote it: a coding cookie must not re-decode it
        source = source.decode("utf-8")
    except UnicodeDecodeError:
        pass  # compile() names the bad byte
    posix.write(ready, b"R")
    posix.close(ready)
    try:
        exec(compile(source, "main.py", "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        e.__traceback__ = e.__traceback__.tb_next  # the user's frames only
        sys.__excepthook__(type(e), e, e.__traceback__)
        raise SystemExit(1) from None


if __name__ == "__main__":
    ROOT, READY = sys.argv[1], int(sys.argv[2])
    install(ROOT)
    run_main(READY)
