"""The Python kernel: a child process that runs cells in one persistent namespace.

Standard library only, Python >= 3.9 (shipped into every sandbox). The supervisor starts it
with ``kernel.main(["-c", "--kernel", CTL_IN, CTL_OUT])`` (``KERNEL_LAUNCHER`` in
``supervisor.py``, started by ``cells.py``) and sends each cell as a frame
on CTL_IN; the kernel answers on CTL_OUT. Its stdout and stderr are the cell's.
"""

# The C core of ``ast``: parsing to a tree and the node classes are all a cell needs, and
# the ``ast`` module's Python half (its unparser, its visitors) is ~5 ms of CPU per kernel.
import _ast as ast
import _signal as signal  # the C core: `signal` imports enum (~2.5 ms of every start)
import builtins
import os
import sys

from display import AfterImport, Display, pyplot_hook
from procs import harden
from wire import FrameWriter, clip_text, read_frame
from workspace import WORKSPACE

GUEST_DIR = os.path.dirname(os.path.abspath(__file__))


# Set by a guest template once it has imported every guest module (template.py): their
# names. None in a kernel of a guest started afresh, which looks them up.
GUEST_MODULES = None


def guest_modules():
    """The names of the guest's modules in ``sys.modules``: a look at every module (~1.2 ms
    of CPU and ~240 pages copied on write in a kernel forked from a template, which is why
    the template makes it once, for all its kernels)."""
    return [
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None)
        and os.path.dirname(os.path.abspath(module.__file__)) == GUEST_DIR
    ]


def hide_guest_modules():
    """Leave the user's imports to the user: their own ``ops.py`` or ``supervisor.py`` in the
    workspace must be what ``import ops`` finds, not the guest's module of that name."""
    sys.path[0] = ""  # the launcher put the guest directory there
    for name in GUEST_MODULES if GUEST_MODULES is not None else guest_modules():
        sys.modules.pop(name, None)


def kernel_main(ctl_in, ctl_out):
    """Run cells sent by the supervisor in one persistent namespace."""
    harden()
    hide_guest_modules()
    try:
        os.chdir(WORKSPACE)
    except OSError:
        pass
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    state = {"in_cell": False, "loop": None, "count": 0, "nonce": None}
    writer = FrameWriter(ctl_out)
    # Each bundle goes to the supervisor as it is shown, tagged with the running cell's nonce.
    shown = Display(lambda bundle: writer.send({"display": bundle, "nonce": state["nonce"]}))
    builtins.display = shown.display  # as in a notebook: no import needed
    sys.meta_path.insert(0, pyplot_hook(shown))
    # The cells' sources, for tracebacks and ``inspect.getsource``: ``linecache`` (with
    # ``tokenize`` and ``re``, ~3.5 ms of every kernel's start) loads with the first traceback
    # or source lookup, and gets every cell's source then.
    sources = {}
    sys.meta_path.insert(0, AfterImport("linecache", lambda module: module.cache.update(sources)))

    def on_sigint(signum, frame):
        # Interrupts only land inside a cell; between cells they would corrupt the protocol.
        if state["in_cell"]:
            raise KeyboardInterrupt

    def run_cell(code):
        state["count"] += 1
        # A path entry that was no directory when an import looked at it is cached as None
        # for good: the kernel starts (and, forked, imports) before a cell can make
        # /workspace/lib, so PYTHONPATH=/workspace/lib would never be searched. Forget those
        # (a dict scan; finders of real directories keep their caches).
        cache = sys.path_importer_cache
        for entry in [entry for entry, finder in cache.items() if finder is None]:
            del cache[entry]
        filename = "<cell-%d>" % state["count"]
        entry = (len(code), None, code.splitlines(True), filename)
        # Into both once linecache is there: a thread of an earlier cell may be importing it
        # right now (its module half-run, no cache yet, or the hook's copy already made).
        sources[filename] = entry
        cache = getattr(sys.modules.get("linecache"), "cache", None)
        if cache is not None:
            cache[filename] = entry
        result = {"exit_code": 0, "text": None, "error": None}
        try:
            state["in_cell"] = True
            tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST)  # as ast.parse does
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
            body = compile(tree, filename, "exec", flags=flags)
            value = None
            if body.co_flags & 0x80:  # CO_COROUTINE: the cell used top-level await
                value = _run_async(eval(body, namespace))
            else:
                exec(body, namespace)
            if last is not None:
                expr = compile(last, filename, "eval", flags=flags)
                value = eval(expr, namespace)
                if expr.co_flags & 0x80:
                    value = _run_async(value)
                if value is not None:
                    namespace["_"] = value
                    result["text"] = repr(value)
                    shown.show(value, is_main_result=True, plain=result["text"])
        except SystemExit as exc:
            code_value = exc.code
            if code_value is None:
                result["exit_code"] = 0
            elif isinstance(code_value, int):
                result["exit_code"] = code_value
            else:
                sys.stderr.write("%s\n" % (code_value,))
                result["exit_code"] = 1
        except BaseException as exc:  # the cell's failure is a result, not our crash
            result["exit_code"] = 1
            result["error"] = _describe(exc)
        finally:
            state["in_cell"] = False
        try:
            shown.flush_figures()  # after a failed cell too: its figures must not linger
        except Exception as exc:
            sys.stderr.write("display: a figure could not be shown: %r\n" % (exc,))
        return result

    def _run_async(awaitable):
        if state["loop"] is None:
            # Imported on the first top-level await only: asyncio (with ssl and
            # concurrent.futures) is ~25 ms of CPU that every kernel start paid, for cells
            # that seldom await.
            import asyncio

            state["loop"] = asyncio.new_event_loop()
        return state["loop"].run_until_complete(awaitable)

    def _describe(exc):
        import traceback  # a failed cell's cost, not every kernel's

        # Hide the kernel's own frames: the traceback should show only the user's code.
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(te.format())}

    # Children of cells must not inherit the control socket. A forked child still holds it,
    # so the supervisor keeps only bytes the kernel itself sent (their sender's pid, which
    # the kernel vouches for: SO_PASSCRED), and every reply echoes the request's nonce.
    os.set_inheritable(ctl_in, False)
    os.set_inheritable(ctl_out, False)
    while True:
        signal.signal(signal.SIGINT, on_sigint)
        try:
            request = read_frame(ctl_in)
        except EOFError:
            return
        except KeyboardInterrupt:
            continue
        result = None
        state["nonce"] = request.get("nonce")
        # Rich outputs share the cell's output cap: their total wire size stays under it.
        shown.start_cell(int(request.get("text_limit", 1 << 20)))
        while result is None:
            try:
                result = run_cell(request["code"])
            except KeyboardInterrupt:
                result = {
                    "exit_code": 1,
                    "text": None,
                    "error": {"type": "KeyboardInterrupt", "message": "", "traceback": ""},
                }
        # Bounded by their size in the frame, not their length: a repr or a message full of
        # control characters grows up to six times when escaped.
        limit = int(request.get("text_limit", 1 << 20))
        result["text"] = clip_text(result["text"], limit)
        if result["error"] is not None:
            for key in ("message", "traceback"):
                result["error"][key] = clip_text(result["error"][key], limit)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        result["nonce"] = request.get("nonce")
        writer.send(result)


def _close_fds_above(keep_fd):
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        os.closerange(keep_fd + 1, 65536)
        return
    for name in names:
        if int(name) > keep_fd:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor, closed already


def _stdio(fd, mode, errors, name):
    """A standard stream as ``python3 -u`` makes it: unbuffered bytes, text written through."""
    import io

    raw = io.FileIO(fd, mode, closefd=False)
    raw.name = name
    if mode == "r":
        stream = io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors=errors)
    else:
        stream = io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=True)
    stream.mode = mode
    return stream


def forked_main(ctl, stdout_fd, stderr_fd, env, cwd):
    """The kernel in a child forked from the single-threaded supervisor: turn the process
    into what ``python3 -s -u -c KERNEL_LAUNCHER`` gives (``Kernel.ensure`` in ``cells.py``),
    then run cells. ``cells.forkable`` has checked that ``env`` asks a fresh interpreter for
    nothing this does not reproduce. The caller has made it a session leader already."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the host's protocol pipes end here: 0 and 1 are the cell's now
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.dup2(ctl, 3)
    # Every other descriptor is the supervisor's: its ends of the pipes and the socket.
    _close_fds_above(3)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    os.environ.clear()
    os.environ.update(env)
    sys.argv[:] = ["-c", "--kernel", "3", "3"]
    sys.stdin = sys.__stdin__ = _stdio(0, "r", "strict", "<stdin>")
    sys.stdout = sys.__stdout__ = _stdio(1, "w", "strict", "<stdout>")
    sys.stderr = sys.__stderr__ = _stdio(2, "w", "backslashreplace", "<stderr>")
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    # The supervisor runs with -I -S: the path a fresh interpreter would have is its own
    # plus PYTHONPATH ahead of the standard library, and the site directories after it
    # (site.main() adds no user site directory here: -I implies -s).
    user_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [GUEST_DIR] + user_path + [p for p in sys.path if p and p != GUEST_DIR]
    # The site directories (~7-9 ms of CPU with a distribution's .pth files) load before the
    # gate, while the host still waits for the supervisor's ready, where that changes
    # nothing: with no PYTHONPATH every entry on the path is read-only (the guest directory,
    # the standard library, the site directories), so sitecustomize.py and the .pth files'
    # imports resolve exactly as they would after it. A PYTHONPATH could shadow them (or
    # ``site`` itself), so then they wait for the gate.
    if not user_path:
        import site

        site.main()
    # The gate: from here on the sandbox's own files can run (PYTHONPATH, .pth files,
    # sitecustomize.py planted in /workspace by earlier calls). Not before the supervisor has
    # read the host's key and the host has bounded the sandbox (its terminals): the
    # supervisor sends one byte then (``Kernel.open_gate``).
    try:
        if not os.read(3, 1):
            os._exit(0)  # the supervisor is gone
    except OSError:
        os._exit(0)
    if user_path:
        import site

        site.main()
    kernel_main(3, 3)


def main(argv):
    """Entry point of the kernel process: ``argv`` is ``[..., "--kernel", CTL_IN, CTL_OUT]``."""
    kernel_main(int(argv[-2]), int(argv[-1]))
