"""A hostile or broken server on 127.0.0.1 (a real HTTP server answering what a real SGLang server
never would): the client reads and deletes nothing outside its capture dir, and every malformed
answer ends in a named failure, not a traceback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from eaglenest.extraction.backends import SampleFailed
from eaglenest.extraction.backends.sglang_client import SGLangBackend
from eaglenest.runtime.errors import EaglenestError
from sglang_patch.protocol import CAPTURE_VERSION, RECEIPT_KEY

TAPS = [2, 15, 27]


class FakeServer:
    """answer(body) -> bytes of the /generate response."""

    def __init__(self, answer):
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = outer.answer(body)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.answer = answer
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def receipt(body, path, **over):
    rc = {
        "path": path,
        "n_positions": len(body["input_ids"]),
        "prefix_len": 0,
        "taps": TAPS,
        "capture_version": CAPTURE_VERSION,
        **over,
    }
    return json.dumps(
        {"meta_info": {"cached_tokens": 0, "prompt_tokens": len(body["input_ids"]), RECEIPT_KEY: [rc]}}
    ).encode()


def backend(smollm2, url, cap):
    return SGLangBackend(smollm2, TAPS, dtype="bfloat16", device="cpu", server_url=url, capture_dir=str(cap), retries=1)


def test_a_receipt_naming_a_file_outside_the_capture_dir_deletes_nothing(smollm2, tmp_path):
    cap = tmp_path / "capture"
    cap.mkdir(mode=0o700)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    for path in (str(precious), str(cap / ".." / "precious.txt")):
        srv = FakeServer(lambda body, path=path: receipt(body, path))
        be = backend(smollm2, srv.url, cap)
        try:
            with pytest.raises(EaglenestError, match="refusing to read or delete it"):
                be.extract([np.arange(5, 12)])
        finally:
            be.close()
            srv.close()
        assert precious.read_text() == "keep me"


def test_a_link_planted_at_the_capture_path_is_not_followed(smollm2, tmp_path):
    cap = tmp_path / "capture"
    cap.mkdir(mode=0o700)
    precious = tmp_path / "precious.safetensors"
    precious.write_bytes(b"x" * 100)

    def answer(body):
        (cap / f"{body['rid']}.safetensors").symlink_to(precious)  # what a hostile server could do
        return receipt(body, str(cap / f"{body['rid']}.safetensors"))

    srv = FakeServer(answer)
    be = backend(smollm2, srv.url, cap)
    try:
        with pytest.raises(EaglenestError):  # the receipt resolves outside the dir
            be.extract([np.arange(5, 12)])
    finally:
        be.close()
        srv.close()
    assert precious.read_bytes() == b"x" * 100 and not any(cap.iterdir())  # the link is gone, its target kept


@pytest.mark.parametrize(
    "answer",
    [
        lambda body: b"<html>not json</html>",
        lambda body: b"[]",
        lambda body: json.dumps({"meta_info": "oops"}).encode(),
        lambda body: json.dumps({"meta_info": {"cached_tokens": 0, RECEIPT_KEY: "x"}}).encode(),
        lambda body: receipt(body, 42),
        lambda body: receipt(body, "a.safetensors", n_positions="7"),
        lambda body: receipt(body, "a.safetensors", taps=None),
    ],
)
def test_malformed_answers_fail_the_sample_by_name(smollm2, tmp_path, answer):
    cap = tmp_path / "capture"
    cap.mkdir(mode=0o700)
    srv = FakeServer(answer)
    be = backend(smollm2, srv.url, cap)
    try:
        with pytest.raises(SampleFailed, match="SGLang capture failed 2 times"):
            be.extract([np.arange(5, 12)])
    finally:
        be.close()
        srv.close()


def test_a_corrupt_capture_file_is_rejected_and_retried(smollm2, tmp_path):
    """safetensors 0.8's error is not a ValueError: it was a raw traceback, and no retry."""
    cap = tmp_path / "capture"
    cap.mkdir(mode=0o700)
    seen = []

    def answer(body):
        path = cap / f"{body['rid']}.safetensors"
        path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        seen.append(path)
        return receipt(body, str(path))

    srv = FakeServer(answer)
    be = backend(smollm2, srv.url, cap)
    try:
        with pytest.raises(SampleFailed, match="unreadable"):
            be.extract([np.arange(5, 12)])
    finally:
        be.close()
        srv.close()
    assert len(seen) == 2 and not any(p.exists() for p in seen)  # retried, and each file deleted


def test_server_url_without_capture_dir_is_refused(smollm2):
    with pytest.raises(EaglenestError, match="capture_dir is required with server_url"):
        SGLangBackend(smollm2, TAPS, server_url="http://127.0.0.1:1")
