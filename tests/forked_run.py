"""The client of tests/zygote.py: a run of train_fsdp.py forked from a server that has its imports done, used
like subprocess.Popen (pid, communicate, kill, returncode) by conftest.run_train.

    python -m pytest tests -q      (used by the tests; see tests/zygote.py for why)
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZYGOTE = os.path.join(ROOT, "tests", "zygote.py")
# Read when torch, transformers or huggingface_hub are imported, so the server's values would stand: a run whose
# environment sets one of these differently is exec'd (e.g. tests/test_hub.py's HF_ENDPOINT).
READ_AT_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "OMP_", "MKL_", "PYTHON", "CUDA", "LD_", "CC", "CXX")
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}  # what every forked run gets

_server: dict = {}  # this pytest process's server: {"proc": Popen, "path": socket path, "env": its environment}
_forked_cpu = [0.0]  # CPU-seconds of the runs forked for this pytest process that have ended


def cpu_seconds() -> float:
    """CPU-seconds used so far by this pytest process, the processes it waited for (exec'd runs, spawned ranks),
    the runs the server forked for it and the ranks the fork server forked for it (start_ranks). Not counted:
    servers still running (Azurite, SLURM's daemons and the job steps they start)."""
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + _forked_cpu[0] + _ranks_cpu()


def can_fork(env: dict[str, str]) -> bool:
    """Whether a run with environment `env` may be forked from the server: no variable read at import differs.
    TESTS_EXEC_ALL=1 in pytest's environment execs every run (to time the difference, or to rule the fork out)."""
    if os.environ.get("TESTS_EXEC_ALL") == "1":
        return False
    server_env = server()["env"]
    keys = {k for k in (*env, *server_env) if k.startswith(READ_AT_IMPORT)}
    return all(env.get(k) == server_env.get(k) for k in keys)


def server() -> dict:
    """This pytest process's server, started on first use (its imports take a few seconds, once)."""
    if _server and _server["proc"].poll() is None:
        return _server
    path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "socket")
    env = {**os.environ, **SERVER_ENV}
    proc = subprocess.Popen([sys.executable, ZYGOTE, path], cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"tests/zygote.py did not start (exit {proc.poll()})")
        time.sleep(0.05)
    _server.update(proc=proc, path=path, env=env)
    return _server


class ForkedRun:
    """`argv` (after python: a script and its arguments, or -m torch.distributed.run ...) run by the server in
    `cwd` with environment `env`; its stdout and stderr come back through pipes, as from Popen(..., PIPE)."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str]):
        self.args = [sys.executable, *argv]
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(server()["path"])
        socket.send_fds(self._sock, [json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()], [out_w, err_w])
        self._sock.shutdown(socket.SHUT_WR)
        os.close(out_w)
        os.close(err_w)
        self._pipes = {out_r: [], err_r: []}
        self._reply = self._sock.makefile("r")
        self.pid = int(self._reply.readline())

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr until the run and every process it started have closed them, then its exit
        status; subprocess.TimeoutExpired after `timeout` seconds (call again after kill() for the rest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self._pipes:
                if not self._closed(fd):
                    sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    self._pipes[key.fd].append(chunk)
                    if not chunk:
                        sel.unregister(key.fd)
                        os.close(key.fd)
        if self.returncode is None:
            code, cpu_s = self._reply.readline().split()
            self.returncode = int(code)
            _forked_cpu[0] += float(cpu_s)
            self._sock.close()
        out, err = (b"".join(chunks).decode(errors="replace") for chunks in self._pipes.values())
        return out, err

    def _closed(self, fd: int) -> bool:
        return bool(self._pipes[fd]) and self._pipes[fd][-1] == b""

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.returncode is None:
            self.kill()
            self.communicate()


# ---------------------------------------------------------------- ranks a test starts itself (start_ranks)
# multiprocessing's fork server: a fresh python per pytest process, started on first use, that has imported what a
# run imports once (RANK_PRELOAD, as the server above); each rank is a fork of it. A spawned rank imported all that
# itself, about 4 CPU-s each. Not a fork of the pytest process: once any test ran a matmul, that can hang in OpenMP.
# What tests/zygote.py imports, no more: conftest asks torch.cuda for the device count at import, which a process
# that forks CUDA ranks must not have done.
RANK_PRELOAD = ["torch.distributed.run", "train_fsdp"]
_rank_server: dict = {}  # {"pid": the fork server's pid, "env": os.environ when it started, "cpu": file of CPU-s}


def start_ranks(fn, args: tuple, nprocs: int, start_method: str = "forkserver", join: bool = True):
    """torch.multiprocessing.start_processes(fn, args, nprocs, start_method, join); "forkserver": forked from the
    fork server as a spawned rank would start, in this process's environment and cwd, ending as it would
    (non-daemon threads joined, atexit handlers run). Spawned instead when the environment differs from the
    server's in a variable read at import. Not joined: the ranks' ProcessContext."""
    import torch.multiprocessing
    if start_method == "forkserver":
        if _rank_server_env_differs():
            start_method = "spawn"
        else:
            fn, args = _rank, (fn, dict(os.environ), os.getcwd(), _rank_server["cpu"], args)
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=start_method)


def _rank_server_env_differs() -> bool:
    """Start the fork server if it is not running (again: its pid changed), and say whether this process's
    environment differs from the one it started with in a variable read at import."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    forkserver.ensure_running()
    if _rank_server.get("pid") != forkserver._forkserver._forkserver_pid:
        fd, cpu = tempfile.mkstemp(prefix="rank-cpu-")
        os.close(fd)
        _rank_server.update(pid=forkserver._forkserver._forkserver_pid, env=dict(os.environ), cpu=cpu)
    keys = {k for k in (*os.environ, *_rank_server["env"]) if k.startswith(READ_AT_IMPORT)}
    return any(os.environ.get(k) != _rank_server["env"].get(k) for k in keys)


def _rank(rank: int, fn, env: dict, cwd: str, cpu_file: str, args: tuple) -> None:
    """One rank in the fork server's child: the caller's environment and cwd, then fn(rank, *args); at its end what
    a spawned rank's python does before it exits (the fork server's child ends in os._exit), and its CPU-seconds
    added to `cpu_file` for cpu_seconds."""
    import atexit
    import threading
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        fn(rank, *args)
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()
        own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(cpu_file, "a") as f:
            f.write(f"{own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime}\n")


def _ranks_cpu() -> float:
    try:
        with open(_rank_server["cpu"]) as f:
            return sum(float(line) for line in f)
    except (KeyError, OSError, ValueError):
        return 0.0
