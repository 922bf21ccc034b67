"""Real remote servers on 127.0.0.1 for DVC tests: OpenSSH's sshd (key auth, SFTP) and moto's
S3-compatible server. Each runs as a child process on a free port and is stopped afterwards."""

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:] if log.exists() else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def sshd_binary() -> str | None:
    return shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


class SSHServer:
    def __init__(self, root: Path):
        self.root, self.port, self.user = Path(root), free_port(), getpass.getuser()
        self.key = self.root / "client_key"
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / name)], check=True)
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        cfg = self.root / "sshd_config"
        cfg.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.root / 'host_key'}",
                    f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    f"PidFile {self.root / 'sshd.pid'}",
                    "Subsystem sftp internal-sftp",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege-separation directory sshd insists on
        self.log = self.root / "sshd.log"
        self.proc = subprocess.Popen([sshd_binary(), "-D", "-f", str(cfg), "-E", str(self.log)])
        wait_port(self.port, self.proc, self.log)

    def url(self, path: Path) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class S3Server:
    """moto in server mode (in-process mocking cannot reach s3fs/aiobotocore)."""

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def __init__(self, root: Path, bucket: str = "dvc-remote"):
        self.port, self.bucket, self.log = free_port(), bucket, Path(root) / "moto.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
            )
        wait_port(self.port, self.proc, self.log)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            **{k.lower(): v for k, v in self.env.items() if k != "AWS_DEFAULT_REGION"},
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
