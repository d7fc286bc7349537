"""A Python that has imported torch, Lightning and the engine once, and forks a new process for each entry-point run.

Every `python train.py ...` costs about 5 s of CPU importing torch and Lightning before the job starts; on 2 cores
those imports were most of the suite's time. `run()` and `start()` (engine/tests/conftest.py) send their command here
instead: the server forks, and the child runs the script as `python <script> <args>` (or the module as `python -m
<module> <args>`: torchrun's agent, the Ray driver, the equivalence check) would, with the command's sys.argv,
`__main__`, sys.path, working directory, environment and standard streams, from a process that has the modules
already imported.

The processes a run starts with `sys.executable` (Lightning's launcher starting ranks 1..N-1, the equivalence check
starting its runs, ddp_spawn's processes in a sweep) are served the same way: in a run, `sys.executable` is a relay
(RELAY below, a Python without site-packages that starts in milliseconds) that sends its command, and the descriptors
it was given (multiprocessing's pipes), here and then stands for the forked process: it passes signals on, exits with
its exit code, and a SIGKILL of the relay kills the process too. Everything else is a fresh interpreter, as for a
user: torchrun's workers (they find their agent as their parent process), Ray's workers, a command with interpreter
flags of its own, and a command whose start-up variables (STARTUP_VARIABLES) differ from the server's.

`python engine/tests/preloaded.py SOCKET` serves until its stdin closes (its pytest worker exited). Each request is one
packet: the command as JSON plus its file descriptors (stdin, stdout, stderr, then any other it was given). A waiter
process forked per request answers with the run's pid, then with its exit code (negative: the signal that ended it),
as Popen does.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import multiprocessing
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading

PRELOAD = ("torch", "lightning", "hydra", "scaleup.train", "scaleup.evaluate", "scaleup.export")
# Variables read once, when Python, glibc or torch starts: a command that sets them differently runs in a fresh
# interpreter.
STARTUP_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "MALLOC_MMAP_THRESHOLD_",
    "LD_PRELOAD",
)
SOCKET_VARIABLE = "SCALEUP_TEST_PRELOADED"  # the server's socket, for the relay
RELAY = """
import json, os, signal, socket, sys

PYTHON, STARTUP, FLAGS = %r, %r, %r
argv = sys.argv[1:]
# multiprocessing's spawn: `<the parent's flags> -c "from multiprocessing.spawn import spawn_main; ..."
# --multiprocessing-fork`, with the pipes it reads its process from passed as open descriptors: they travel to the
# server, at the same numbers.
code = argv[len(FLAGS) :] if argv[: len(FLAGS)] == FLAGS else argv
spawned = code[:1] == ["-c"] and code[1:2] != [] and code[1].startswith("from multiprocessing.spawn")
argv = code if spawned else argv
flags = argv[0].startswith("-") and argv[0] != "-m" and not spawned
torchrun_worker = "TORCHELASTIC_RUN_ID" in os.environ  # it finds its agent as its parent process
if flags or torchrun_worker or {v: os.environ.get(v) for v in STARTUP} != STARTUP:
    os.execv(PYTHON, [PYTHON, *argv])  # a fresh interpreter
passed = []
for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
    try:
        if fd > 2 and os.fstat(fd):  # not the listing's own, closed by now
            passed.append(fd)
    except OSError:
        pass
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(os.environ[%r])
request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "relay": os.getpid(), "fds": passed}
socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *passed])
pid = int(conn.recv(64))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda sig, frame: os.kill(pid, sig))
code = int(conn.recv(64))
if code < 0:  # end as the run did: killed by the same signal (SIGKILL has no handler to reset)
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def serve(path: str) -> tuple[dict, list[int]]:
    """Accept requests until stdin closes; returns only in a forked child, with the request it is to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    relay = os.path.join(os.path.dirname(path), "python")
    startup = {name: os.environ.get(name) for name in STARTUP_VARIABLES}
    with open(relay, "w") as out:
        out.write(
            f"#!{sys.executable} -IS\n"
            + RELAY % (sys.executable, startup, subprocess._args_from_interpreter_flags(), SOCKET_VARIABLE)
        )
    os.chmod(relay, 0o755)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in readable:
            sys.exit(0)
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                return {**json.loads(message), "socket": path, "relay_path": relay}, fds
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            _, status = os.waitpid(pid, 0)
            conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def die_with(pid: int) -> None:
    """SIGKILL this process when process `pid` (its relay) ends, as a fresh interpreter dies with a SIGKILL."""
    watch = os.pidfd_open(pid)

    def wait() -> None:
        select.select([watch], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, daemon=True).start()


def become(request: dict, fds: list[int]) -> tuple[str, str]:
    """Turn this forked child into `python <script> <args>`, `python -m <module> <args>` or a spawned
    multiprocessing child started with the request's cwd, env, streams and descriptors; returns ("path", script),
    ("module", module) or ("code", the code of `-c`)."""
    numbers = [0, 1, 2, *request.get("fds", [])]
    above = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # out of the way of the numbers they take
    for fd in fds:
        os.close(fd)
    for fd, number in zip(above, numbers, strict=True):
        os.dup2(fd, number)
        os.close(fd)
    os.chdir(request["cwd"])
    argv, env = request["argv"], request["env"]
    if "relay" in request:
        die_with(request["relay"])
    served_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ.clear()
    os.environ.update(env)
    kind, name = {"-m": ("module", argv[1]), "-c": ("code", argv[1])}.get(argv[0], ("path", argv[0]))
    sys.argv = {"module": argv[1:], "code": ["-c", *argv[2:]]}.get(kind, argv)  # runpy puts the module's file in [0]
    sys.executable = request["relay_path"]  # the processes the run starts come here through the relay
    multiprocessing.set_executable(sys.executable)  # spawn's copy, taken when the server imported it
    os.environ[SOCKET_VARIABLE] = request["socket"]
    # sys.path as the interpreter makes it: the script's folder (for -m, the working directory), then PYTHONPATH,
    # then the installed packages.
    added = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = [p for p in sys.path[1:] if p not in served_path]
    first = os.path.dirname(os.path.abspath(name)) if kind == "path" else os.getcwd()
    sys.path[:] = [first, *added, *installed]
    import numpy as np

    np.random.seed()  # a fresh interpreter draws its own unseeded state; forked ones would share the server's
    return kind, name


if __name__ == "__main__":
    request, fds = serve(sys.argv[1])
    kind, name = become(request, fds)
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    elif kind == "code":
        exec(compile(name, "<string>", "exec"), {"__name__": "__main__"})
    else:
        runpy.run_path(name, run_name="__main__")
