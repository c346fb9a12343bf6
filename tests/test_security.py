"""What TensorFlow's servers expose, and what the local launcher does about it.

docs/operations.md's security section rests on these: a `tf.distribute.Server` given
127.0.0.1 in its cluster listens on every interface, and the launcher refuses
to start a job on a port something (here: such a server) already holds.
"""

import os
import subprocess
import sys
import textwrap

from conftest import run_module

# Starts a TF server for 127.0.0.1:PORT, prints where the kernel says it listens, then waits.
SERVER = textwrap.dedent("""
    import sys, tensorflow as tf
    port = int(sys.argv[1])
    server = tf.distribute.Server({"worker": [f"127.0.0.1:{port}"]}, job_name="worker",
                                  task_index=0, protocol="grpc", start=True)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
      with open(table) as f:
        for line in f.readlines()[1:]:
          local, state = line.split()[1], line.split()[3]
          address, hex_port = local.rsplit(":", 1)
          if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            listening.append(address)
    print("listening", " ".join(listening), flush=True)
    sys.stdin.read()
""")


def two_free_ports():
  """A port p with p - 1 and p both free now."""
  import socket  # pylint: disable=import-outside-toplevel
  for _ in range(50):
    with socket.socket() as a, socket.socket() as b:
      try:
        a.bind(("", 0))
        b.bind(("", a.getsockname()[1] - 1))
      except OSError:
        continue
      return a.getsockname()[1]
  raise AssertionError("no two consecutive free ports")


def test_a_tf_server_for_127_0_0_1_listens_on_every_interface_and_the_launcher_refuses_its_port():
  port = two_free_ports()
  server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  try:
    line = server.stdout.readline().split()
    assert line and line[0] == "listening", "the TF server did not start"
    # All-zero addresses: 0.0.0.0 (tcp) or :: (tcp6), never 127.0.0.1 (0100007F).
    assert line[1:] and all(set(address) == {"0"} for address in line[1:]), line
    proc = run_module("tfpar.launch", [
        "--num_workers=2", f"--port_base={port - 1}", "--", "--model_dir=/tmp/unused",
        "--strategy=multi_worker_mirrored"], check=False, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"tfpar.launch: error: port(s) {port} already in use: stop what listens there, or pass "
        "another --port_base (or 0 to pick free ports)"]
  finally:
    server.kill()
    server.wait()
