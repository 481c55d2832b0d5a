"""The quick-start example `make run` executes: a real sandbox on the bubblewrap backend."""

from sandlot import Sandbox

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
