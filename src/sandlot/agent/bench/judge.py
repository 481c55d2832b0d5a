"""The hidden tests' judge: the candidate in a process of its own, out of reach of the tests.

The scoring program was the candidate, then its hidden tests, then a line printed when they
passed, all one file in one process: a candidate that read its own file (``__file__``) saw the
tests and the line, printed it and exited 0, and wrong code scored as passing (red team,
2026-12-06). In one process no wall is possible (the candidate can walk the caller's frames
to the same constants). So the judge:

1. makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: its ``/proc/<pid>/mem``, ``fd`` and
   ``environ`` are closed to the candidate's processes, which share its uid; seccomp already
   refuses ``ptrace`` and ``process_vm_readv``) and deletes its own file, which holds the
   tests and the line;
2. starts the candidate in a child interpreter whose stdout and stderr go nowhere the run's
   output can be seen, and which is told only the candidate's code;
3. runs the tests in its own process against a stand-in for the entry point that sends each
   call's arguments to the child and gets the value back as plain data (tagged JSON: no
   object of the candidate's, no pickle, nothing whose ``__eq__`` the candidate wrote);
4. prints the line once the tests returned, the child never having had it.

The task's prompt is the task author's code (its helpers, ``poly`` in HumanEval/32) and is run
in the judge's process, as the tests are.
"""

from __future__ import annotations

# Values cross between the two processes as tagged JSON, plain data only.
CODEC = r"""
def encode(value, depth=0):
    if depth > 64:
        raise TypeError("nested too deep")
    if value is None or isinstance(value, (bool, str)):
        return str(value) if isinstance(value, str) else value
    if isinstance(value, int):  # an IntEnum, a bool subclass aside: its value
        return int(value)
    if isinstance(value, float):
        return {"f": repr(float(value))}
    if isinstance(value, complex):
        return {"c": [repr(value.real), repr(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, dict):  # a Counter, a defaultdict: their items
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    for kind, tag in ((list, "l"), (tuple, "t"), (frozenset, "z"), (set, "s")):
        if isinstance(value, kind):
            return {tag: [encode(v, depth + 1) for v in value]}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist(), depth + 1)  # a numpy scalar or array: its plain value
    if (hasattr(value, "__iter__") and hasattr(value, "__next__")) or isinstance(value, range):
        # An iterator (map, filter, a generator) or a range: its items, given back as an
        # iterator, so that list() of it works and it equals no list, as in one process.
        return {"i": [encode(v, depth + 1) for v in value]}
    raise TypeError("a value of type " + type(value).__name__ + " cannot be judged")

def decode(value):
    if not isinstance(value, dict):
        return value
    (tag, item), = value.items()
    if tag == "f":
        return float(item)
    if tag == "c":
        return complex(float(item[0]), float(item[1]))
    if tag == "b":
        return bytes.fromhex(item)
    if tag == "d":
        return {decode(k): decode(v) for k, v in item}
    if tag == "i":
        return iter([decode(v) for v in item])
    return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](decode(v) for v in item)
"""

# The candidate's process: loads the code it is given on stdin, then answers calls.
CHILD = (
    CODEC
    + r"""
import json, os, sys
calls, replies = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
def reply(message):
    replies.write(json.dumps(message) + "\n")
    replies.flush()
module = {"__name__": "candidate"}
try:
    exec(compile(sys.stdin.read(), "candidate.py", "exec"), module)
    entry = module[sys.argv[3]]
except BaseException as exc:
    reply({"load": type(exc).__name__})
    raise SystemExit(1)
reply({"load": None})
for line in calls:
    call = json.loads(line)
    args = decode(call["args"])
    try:
        answer = {"ok": encode(entry(*args, **decode(call["kwargs"])))}
    except BaseException as exc:
        answer = {"raised": type(exc).__name__}
    try:
        answer["args"] = encode(args)  # as the call left them: it may change them in place
    except TypeError:
        pass
    reply(answer)
"""
)

JUDGE = r"""
import builtins, ctypes, json, os, subprocess, sys

ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: 0
os.unlink(__file__)

CANDIDATE, PROMPT, TESTS, ENTRY, LINE, CODEC, CHILD = {payload}
exec(CODEC)

child_reads, judge_writes = os.pipe()
judge_reads, child_writes = os.pipe()
child = subprocess.Popen(
    [sys.executable, "-I", "-c", CHILD, str(child_reads), str(child_writes), ENTRY],
    stdin=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    pass_fds=(child_reads, child_writes),
)
os.close(child_reads)
os.close(child_writes)
child.stdin.write(CANDIDATE.encode())
child.stdin.close()
calls, replies = os.fdopen(judge_writes, "w"), os.fdopen(judge_reads, "r")

def answer():
    line = replies.readline()
    if not line:
        raise RuntimeError("the candidate's process ended")
    return json.loads(line)

loaded = answer()["load"]
if loaded is not None:
    raise RuntimeError("the candidate did not load: " + loaded)

def changed_in_place(args, after):
    for given, now in zip(args, after):
        if isinstance(given, list) and isinstance(now, list):
            given[:] = now
        elif isinstance(given, (dict, set)) and type(now) is type(given):
            given.clear()
            given.update(now)

def entry(*args, **kwargs):
    calls.write(json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}) + "\n")
    calls.flush()
    reply = answer()
    if "args" in reply:
        changed_in_place(args, decode(reply["args"]))
    if "raised" in reply:
        error = getattr(builtins, reply["raised"], None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error("raised by the candidate")
        raise RuntimeError(reply["raised"] + " raised by the candidate")
    return decode(reply["ok"])

tests = {"__name__": "__main__"}
exec(compile(PROMPT, "prompt.py", "exec"), tests)
tests[ENTRY] = entry
exec(compile(TESTS, "hidden_tests.py", "exec"), tests)
child.kill()
sys.stdout.write("\n" + LINE + "\n")
"""


def judge_program(candidate: str, prompt: str, tests: str, entry_point: str, line: str) -> str:
    """The scoring program: ``tests`` run against ``candidate``'s ``entry_point`` in a child
    process, ``line`` printed when they pass (see the module's docstring)."""
    payload = repr((candidate, prompt, tests, entry_point, line, CODEC, CHILD))
    return JUDGE.replace("{payload}", payload)
