"""The quick-start example `make run` executes: a real sandbox on the bubblewrap backend."""

import base64
import tempfile
from pathlib import Path

from sandlot import Sandbox, SandboxError

CHART = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3, 4], [1, 4, 9, 16], marker="o")
plt.title("drawn inside the sandbox")
plt.show()
"""


def save_chart(sb: Sandbox) -> None:
    """Draw a chart with matplotlib in ``sb``, or else in a python-data sandbox: the default
    environment runs the host's python3 until its tree is built (`make run` installs
    python3-matplotlib for it), and its built tree holds CPython alone."""
    r = sb.run_code(CHART, timeout_s=60)
    if r.error and r.error.type == "ModuleNotFoundError":
        try:
            with Sandbox.create(environment="python-data", timeout_s=60) as data:
                r = data.run_code(CHART, timeout_s=60)
        except SandboxError as exc:
            print(f"chart: skipped, no matplotlib here ({exc.message})")
            return
    pngs = [result.png for result in r.results if result.png]
    if not pngs:
        print("chart: none came back:", r.error.message if r.error else r.stderr)
        return
    chart = Path(tempfile.gettempdir()) / "sandlot-quickstart-chart.png"
    chart.write_bytes(base64.b64decode(pngs[0]))
    print("chart:", chart)


with Sandbox.create(memory_mb=256, timeout_s=5) as sb:
    # A stateful Python interpreter: variables persist between calls, like notebook cells.
    sb.run_code("x = 41")
    print("x + 1 =", sb.run_code("x + 1").text)

    # Shell commands, with their exit code.
    r = sb.commands.run("echo hi && exit 3")
    print(f"shell: exit_code={r.exit_code} stdout={r.stdout!r}")

    # Files confined to /workspace.
    sb.files.write("data/a.txt", "hello")
    print("file:", sb.files.read("data/a.txt"))

    # A chart drawn in the sandbox comes back as a PNG result (see save_chart below).
    save_chart(sb)

    # Failures are results, not exceptions: an infinite loop is stopped at the timeout...
    r = sb.run_code("while True: pass", timeout_s=1)
    print(f"spin: kill_reason={r.kill_reason} state_lost={r.state_lost}")
    # ...a memory bomb is killed by the sandbox's cgroup...
    r = sb.run_code("b = bytearray(2 * 1024**3)")
    print(f"memory bomb: kill_reason={r.kill_reason}")
    # ...and there is no network unless you ask for it.
    r = sb.run_code("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)")
    print("network:", r.error.message if r.error else "connected?!")
    print("uid inside:", sb.commands.run("id -u").stdout.strip())
