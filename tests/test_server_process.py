"""A server process (eaglenest.runtime.server_process, as SGLang's and vLLM's are run): its scratch files and
IPC sockets live in a TMPDIR of its own, gone once it stops, also after it died or left a worker."""

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess, free_port

# the server: a worker in its process group that ignores SIGTERM, an AF_UNIX socket and a file in
# its temp dir (as vLLM's ZMQ sockets and scratch dirs), then HTTP on the port
SERVER = r"""
import http.server, os, signal, socket, sys, tempfile
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pause()
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(tempfile.gettempdir(), "ipc-socket"))
open(os.path.join(tempfile.gettempdir(), "scratch"), "w").write("x")
print("tmp", tempfile.gettempdir(), flush=True)
http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(sys.argv[1]), bind="127.0.0.1")
"""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("death", ["stopped", "killed"])
def test_server_tmpdir_and_group_go_with_the_server(tmp_path, death):
    port = free_port()
    srv = ServerProcess("toy", [sys.executable, "-c", SERVER, str(port)], port, "/", tmp_path / "server.log")
    with srv:
        tmp = Path(srv.tmp)
        assert tmp.parent == Path(os.environ.get("TMPDIR", "/tmp")) and tmp.name.startswith("eaglenest-server-")
        assert (tmp / "scratch").exists() and (tmp / "ipc-socket").is_socket()
        pgid = srv.proc.pid
        if death == "killed":  # the server dies; its worker lives on in the group
            os.kill(pgid, signal.SIGKILL)
            srv.proc.wait()
            assert group_alive(pgid)
            with pytest.raises(EaglenestError, match=r"toy exited with code -9; log .*server.log"):
                srv.check_alive()
    assert not tmp.exists() and srv.tmp is None
    deadline = time.time() + 10
    while group_alive(pgid) and time.time() < deadline:  # reaped by init after the KILL
        time.sleep(0.1)
    assert not group_alive(pgid)


def test_a_server_that_never_starts_leaves_nothing(tmp_path):
    """Exits at once, or never answers: start fails naming it, and its TMPDIR and processes are gone."""
    tmp_root = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(tmp_root.glob("eaglenest-server-*"))
    port = free_port()
    broken = ServerProcess("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], port, "/", tmp_path / "b.log")
    with pytest.raises(EaglenestError, match="broken exited with code 3"):
        with broken:
            pass
    mute = ServerProcess(
        "mute", [sys.executable, "-c", "import time; time.sleep(60)"], port, "/", tmp_path / "m.log", startup_timeout=2
    )
    with pytest.raises(EaglenestError, match="mute did not become ready within 2 s"):
        mute.start()
    assert broken.tmp is None and mute.tmp is None and set(tmp_root.glob("eaglenest-server-*")) == before
    assert not group_alive(mute.proc.pid)


# a command that starts a server and then waits; `exit_on_error` turns SIGTERM into an exception, so
# its `with` block stops the server (which runs in a session of its own, beyond the signal's reach)
COMMAND = r"""
import sys, time
from pathlib import Path
from eaglenest.runtime.errors import exit_on_error
from eaglenest.runtime.server_process import ServerProcess


@exit_on_error
def main():
    port, server, log = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    with ServerProcess("toy", [sys.executable, "-c", server, str(port)], port, "/", log) as srv:
        print(srv.proc.pid, srv.tmp, flush=True)
        time.sleep(600)


main()
"""


def test_a_terminated_command_stops_its_server(tmp_path):
    import subprocess

    port = free_port()
    cmd = subprocess.Popen(
        [sys.executable, "-c", COMMAND, str(port), SERVER, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid, tmp = cmd.stdout.readline().split()
    try:
        assert group_alive(int(pid)) and Path(tmp).exists()
        cmd.terminate()  # SIGTERM, as `kill` or a job scheduler sends
        assert cmd.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.time() + 10
        while group_alive(int(pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert not group_alive(int(pid)) and not Path(tmp).exists()
    finally:  # a failed check leaves no server behind
        if group_alive(int(pid)):
            os.killpg(int(pid), signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
