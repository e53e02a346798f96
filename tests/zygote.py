"""A python that has imported the trainer once and forks the tests' runs of train_fsdp.py from then on.

    python tests/zygote.py SOCKET      (started by conftest's run_train, one per pytest process; not by hand)

Most of a tiny run's CPU time is imports (torch, torch.distributed.checkpoint, transformers: about 4.5 CPU-s per
process, against under a second of training), and the suite runs hundreds of them on 2 cores. A run asked of this
server is forked from it with those imports done: `python -m torch.distributed.run ...` becomes torchrun's own
main() in the fork, with `--start-method fork --run-path`, so its agent, rendezvous, environment and restarts are
torchrun's and only its ranks are forked instead of exec'd; `python script.py ...` and `python -m module ...` (the
`python -m ckpt` commands) become runpy's. Each run gets the client's stdout and stderr (passed over the socket),
its cwd and environment, a process group of its own, and ends as the python it stands for would: atexit handlers
run, an escaping exception prints its traceback and exits 1.

Tests of the launch itself (what torchrun or python print, signals to the launcher) exec the real thing
(conftest.run_train(..., forked=False)). docs/testing.md says which.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch.distributed.run  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402,F401

import train_fsdp  # noqa: E402,F401  everything a run imports, imported once here

MAX_REQUEST = 1 << 20  # argv, cwd and environment as JSON


def run_exit_hooks() -> None:
    """What Py_Finalize does before the process ends: join non-daemon threads, then run the atexit handlers (the
    process-mode uploader's stop is one)."""
    threading._shutdown()
    atexit._run_exitfuncs()


def end_like_python(run) -> None:
    """Call `run` and leave the process as `python` would after it: exit status from SystemExit (a message
    printed), an escaping exception's traceback on stderr and status 1, then non-daemon threads joined and atexit
    handlers run (the uploader's stop is one) before the streams are flushed."""
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    run_exit_hooks()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def rank_main(script: str, *args: str) -> None:
    """One torchrun rank, forked by the agent (torchrun's --run-path entry point, replaced): the script as __main__,
    then what an exec'd rank does at exit. SystemExit(0) returns, as torchrun's own wrapper expects."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` sets it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        run_exit_hooks()
    if code not in (0, None):
        raise SystemExit(code)


def start_run(request: dict) -> None:
    """In the forked child: become the process the client asked for."""
    os.setpgid(0, 0)  # conftest.kill_workers kills a run's group; the server's is not in it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # PYTHONUNBUFFERED, as run
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    argv = request["argv"]
    if argv[:2] == ["-m", "torch.distributed.run"]:
        torch.distributed.run.run_script_path = rank_main
        sys.argv = ["torchrun", *argv[2:]]
        end_like_python(lambda: torch.distributed.run.main(["--start-method", "fork", "--run-path", *argv[2:]]))
    # A module this server imported (finetune.metrics) run as __main__: python would not have imported it first
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    if argv[0] == "-m":  # sys.path[0] as python sets it: the folder it starts in, or the script's own
        sys.path.insert(0, os.getcwd())
        sys.argv = argv[1:]
        end_like_python(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    sys.argv = list(argv)
    end_like_python(lambda: runpy.run_path(argv[0], run_name="__main__"))


def fork_run(conn: socket.socket, listener: socket.socket, others: list[socket.socket]) -> int:
    """Read one request (JSON, with the client's stdout and stderr as passed descriptors) and fork its run."""
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 2)
    while chunk := conn.recv(MAX_REQUEST):
        data += chunk
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        for s in (listener, conn, *others):
            s.close()
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
        try:
            start_run(request)
        finally:
            os._exit(70)  # start_run ends the process; reaching here is a bug in this file
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid


def serve(path: str) -> None:
    """Fork a run per connection; tell each client its run's pid, then its exit status (Popen's returncode: minus
    the signal that killed it) and the CPU-seconds it used. Ends when the pytest process that started it is gone."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.rename(path + ".tmp", path)  # the client waits for `path`: it appears listening (a connect between bind
    # and listen is refused; under load a run in CI hit that window)
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            running[fork_run(conn, listener, list(running.values()))] = conn
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                cpu_s = usage.ru_utime + usage.ru_stime  # the run and every process it waited for (ranks, uploaders)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)} {cpu_s:.3f}\n".encode())
                except OSError:  # the client gave up on it
                    pass
                conn.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of pytest reaches its runs, not the server
    serve(sys.argv[1])
