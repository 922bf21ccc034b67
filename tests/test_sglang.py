"""The sglang backend against a real SGLang server (CPU, SmolLM2) started through sglang_patch.

The server environment is `.venv-sglang` (`make sglang-env`, which `make test` runs first)."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from eaglenest.extraction.backends import SampleFailed
from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.backends.sglang_client import SGLangBackend
from eaglenest.extraction.backends.sglang_server import LaunchedServer, free_port
from eaglenest.extraction.loop import extract_part
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import HiddenStore
from eaglenest.target.taps import resolve_taps
from sglang_patch import server_env
from sglang_patch.protocol import DEFAULT_RID_PREFIX, ENV_DIR, ENV_RID_PREFIX, ENV_TAPS

from .conftest import (
    CPU_DTYPE,
    REPO,
    assert_stores_agree,
    cosine,
    make_clone,
    random_samples,
    sh,
    tiny_params,
    write_tokenized,
)

pytestmark = pytest.mark.slow
SGPY = REPO / ".venv-sglang" / "bin" / "python"
GATE = {"min_cosine_mean": 0.995, "min_cosine_token": 0.98, "max_rel_err_mean": 0.06, "max_rel_err_token": 0.2}


def start(smollm2, tmp: Path, extra=(), raw=False, taps=None) -> LaunchedServer:
    """A real server on SmolLM2 (CPU_DTYPE, CPU). raw=True bypasses the launcher (plain sglang.launch_server
    with the capture plugin switched on by its environment), so its flags are not enforced."""
    cap = tmp / "capture"
    cap.mkdir(mode=0o700)
    taps = taps or resolve_taps("auto", smollm2.num_layers)
    srv = LaunchedServer(
        SGPY,
        smollm2.model_dir,
        dtype=CPU_DTYPE,
        taps=taps,
        capture_dir=cap,
        device="cpu",
        extra_args=["--max-total-tokens", "16384", *extra],
        log_path=tmp / "server.log",
        startup_timeout=300,
    )
    if raw:
        srv.cmd = [
            str(SGPY),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(smollm2.model_dir),
            "--dtype",
            CPU_DTYPE,
            "--port",
            str(srv.port),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
            "--skip-tokenizer-init",
            "--disable-cuda-graph",
            *[f"{f}" if v is None else f"{f}={v}" for f, v in server_env.CPU_DEFAULTS],
            *extra,
        ]
        srv.env.update(
            {
                ENV_DIR: str(cap),
                ENV_TAPS: ",".join(map(str, taps)),
                ENV_RID_PREFIX: DEFAULT_RID_PREFIX,
                "SGLANG_USE_CPU_ENGINE": "1",
                "PYTHONPATH": os.pathsep.join(
                    str(server_env.STANDINS / s) for s in ("sgl_kernel_cpu", "no_torchvision")
                ),
            }
        )
    srv.start()
    return srv


def test_server_port_taken_fails_fast_and_ports_avoid_the_ephemeral_range(smollm2, tmp_path):
    """A server whose HTTP port is taken (its scheduler's own port-0 sockets once got it) waited
    forever; the launcher names the port, stops the server and raises within its startup. Ports
    come from below the kernel's ephemeral range, which bind(0) never hands out."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(1024 <= free_port() < low for _ in range(20))
    with socket.socket() as taken:
        port = free_port()
        taken.bind(("127.0.0.1", port))
        taken.listen()
        srv = LaunchedServer(
            SGPY,
            smollm2.model_dir,
            dtype=CPU_DTYPE,
            taps=resolve_taps("auto", smollm2.num_layers),
            capture_dir=tmp_path / "capture",
            device="cpu",
            extra_args=["--max-total-tokens", "16384"],
            log_path=tmp_path / "server.log",
            startup_timeout=300,
        )
        srv.port, srv.url = port, f"http://127.0.0.1:{port}"
        srv.cmd[srv.cmd.index("--port") + 1] = str(port)
        t = time.time()
        with pytest.raises(EaglenestError, match=f"could not bind its port {port}"):
            srv.start()
        assert time.time() - t < 200 and not srv.alive()


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    srv = start(smollm2, tmp_path_factory.mktemp("sglang"))
    yield srv
    srv.stop()


def client(smollm2, srv, taps=None, **kw) -> SGLangBackend:
    taps = taps or resolve_taps("auto", smollm2.num_layers)
    return SGLangBackend(
        smollm2, taps, dtype=CPU_DTYPE, device="cpu", server_url=srv.url, capture_dir=str(srv.capture_dir), **kw
    )


# --- the capture code alone -----------------------------------------------------------------------


def test_requests_in_batch_slices_rows_and_skips_foreign_rids():
    from sglang_patch.capture import aux_rows, requests_in_batch

    reqs = requests_in_batch(["warmup", "eaglenest-a", "eaglenest-b"], [3, 5, 2], [0, 0, 4], "eaglenest-")
    assert [(r.index, r.rid, r.start, r.length, r.prefix_len) for r in reqs] == [
        (1, "eaglenest-a", 3, 5, 0),
        (2, "eaglenest-b", 8, 2, 4),
    ]
    listed = [torch.randn(10, 4) for _ in range(3)]
    assert torch.equal(aux_rows(listed, 4), torch.stack(listed, 1))
    assert torch.equal(aux_rows(torch.cat(listed, -1), 4), torch.stack(listed, 1))  # packed [T, K*H]


# --- the launcher ----------------------------------------------------------------------------------

REFUSED = [
    ["--chunked-prefill-size", "512"],
    ["--chunked-prefill-size=64"],
    ["--radix-cache-backend", "lru"],
    ["--enable-hierarchical-cache"],
    ["--pp-size", "2"],
    ["--enable-mixed-chunk"],
    ["--speculative-algorithm", "EAGLE3"],
    # spellings SGLang's parser accepts: an abbreviation, an alias, --opt=value
    ["--speculative-algo", "EAGLE3"],
    ["--pipeline-parallel-size=2"],
    ["--chunked-prefill=64"],
    ["--enable-hier"],
]


def test_launcher_refuses_contradicting_flags_however_spelled(tmp_path):
    """Judged by what SGLang's own parser makes of the arguments, so no spelling walks around it
    (one process: importing SGLang's parser takes seconds)."""
    code = (
        "import json, sys; from sglang_patch.launch import build\n"
        "out = []\n"
        f"for flags in {REFUSED!r}:\n"
        "    try:\n"
        "        build(['--model-path', 'm', '--capture-dir', sys.argv[1]] + flags); out.append(None)\n"
        "    except SystemExit as e:\n"
        "        out.append(str(e))\n"
        "print(json.dumps(out))"
    )
    got = json.loads(
        subprocess.run(
            [str(SGPY), "-c", code, str(tmp_path / "cap")], capture_output=True, text=True, check=True, timeout=300
        ).stdout.splitlines()[-1]
    )
    for flags, msg in zip(REFUSED, got):
        assert msg and "contradicts hidden-state capture" in msg and flags[0].split("=")[0] in msg, (flags, msg)
    p = subprocess.run(
        [str(SGPY), "-m", "sglang_patch.launch", "--model-path", str(tmp_path), "--speculative-algo", "EAGLE3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "--speculative-algorithm EAGLE3 contradicts hidden-state capture" in p.stderr
    p = subprocess.run(
        [str(SGPY), "-m", "sglang_patch.launch", "--model-path", str(tmp_path), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "unrecognized arguments: --no-such-flag" in p.stderr and len(p.stderr) < 2000


def test_launcher_refuses_unsupported_sglang_version(tmp_path):
    fake = tmp_path / "site"
    (fake / "sglang-0.5.10.dist-info").mkdir(parents=True)
    (fake / "sglang-0.5.10.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.10\n")
    p = subprocess.run(
        [sys.executable, "-m", "sglang_patch.launch", "--model-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{fake}:{REPO}"},
    )
    assert p.returncode != 0 and "sglang 0.5.10 is outside the supported range" in p.stderr


def test_launcher_command_line_in_server_env(tmp_path):
    code = (
        "import json; from sglang_patch.launch import build; a, e, v = build(['--model-path', 'm', '--device', "
        f"'cpu', '--capture-dir', '{tmp_path / 'cap'}']); print(json.dumps([a, e, v]))"
    )
    args, env, version = json.loads(
        subprocess.run([str(SGPY), "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    )
    for flag in ("--disable-radix-cache", "--disable-cuda-graph", "--skip-tokenizer-init"):
        assert flag in args
    assert args[args.index("--chunked-prefill-size") + 1] == "-1" and args[args.index("--pp-size") + 1] == "1"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "sgl_kernel_cpu" in env["PYTHONPATH"]
    assert stat.S_IMODE((tmp_path / "cap").stat().st_mode) == 0o700


def serve_build(*argv) -> tuple[list[str], dict]:
    code = f"import json; from sglang_patch.serve import build; print(json.dumps(build({list(argv)!r})[:2]))"
    out = subprocess.run([str(SGPY), "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_serve_launcher_speculates_on_the_cpu_backend_that_verifies_trees():
    """`sglang_patch.serve` (speculative serving, no capture): EAGLE3 when a drafter is given, and on
    a CPU the attention backend that runs tree verification, given in the two flags SGLang's no-AMX
    fallback leaves alone; the user's own choices win."""
    args, env = serve_build("--model-path", "m", "--device", "cpu", "--speculative-draft-model-path", "d")
    assert args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
    for flag in ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend"):
        assert args[args.index(flag) + 1] == "intel_amx"
    assert "--disable-radix-cache" not in args and args[args.index("--host") + 1] == "127.0.0.1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "sgl_kernel_cpu" in env["PYTHONPATH"]
    plain, _ = serve_build("--model-path", "m", "--device", "cpu", "--decode-attention-backend", "torch_native")
    assert "--speculative-algorithm" not in plain and plain.count("--decode-attention-backend") == 1


# --- a real server ---------------------------------------------------------------------------------


def test_parity_with_hf_store_and_gate(server, smollm2, tmp_path):
    seqs = random_samples(12, 20000, 8, 300, seed=3)
    tok = write_tokenized(tmp_path / "tok.parquet", seqs)
    taps = resolve_taps("auto", smollm2.num_layers)
    stores = {}
    hf_backend = HFBackend(smollm2, taps, dtype=CPU_DTYPE, device="cpu")
    for name, backend in (("sglang", client(smollm2, server)), ("hf", hf_backend)):
        m = extract_part(
            part="p",
            tokenized=tok,
            target=smollm2,
            backend=backend,
            taps=taps,
            dtype=CPU_DTYPE,
            revision=0,
            layout_cfg=dict(chunk_mb=0.05, shard_mb=1, codec="zstd", level=1),
            validate_cfg={"samples": 4, **GATE},
            out_dir=tmp_path / name,
            work_root=tmp_path / "work",
            batch_tokens=1024,
            max_seq_len=512,
            progress=False,
        )
        backend.close()
        assert m["committed"] and m["validation"]["passed"], m["validation"]
        stores[name] = HiddenStore(tmp_path / name)
    s, h = stores["sglang"], stores["hf"]
    assert s.attrs["extractor"]["backend_version"].startswith("sglang-0.5.")
    assert s.attrs["extractor_fingerprint"] != h.attrs["extractor_fingerprint"]
    assert_stores_agree(s, h, seqs, min_cosine=0.99)


def test_32_concurrent_requests_each_match_their_own(server, smollm2):
    seqs = random_samples(32, 20000, 4, 400, seed=5)
    assert len({len(s) for s in seqs}) > 20
    got = client(smollm2, server, concurrency=32).extract(seqs)
    hf = HFBackend(smollm2, resolve_taps("auto", smollm2.num_layers), dtype=CPU_DTYPE, device="cpu")
    for i, (seq, (aux, final)) in enumerate(zip(seqs, got)):
        ref_aux, ref_final = hf.extract([seq])[0]
        assert aux.shape == ref_aux.shape
        assert cosine(aux, ref_aux).mean() > 0.999 and cosine(final, ref_final).mean() > 0.999, i


def test_capture_files_private_and_removed(server, smollm2):
    cap = Path(server.cmd[server.cmd.index("--capture-dir") + 1])
    body = {
        "input_ids": list(range(10, 40)),
        "rid": f"{DEFAULT_RID_PREFIX}perm",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    req = urllib.request.Request(
        f"{server.url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    meta = json.loads(urllib.request.urlopen(req, timeout=120).read())["meta_info"]
    path = Path(meta["hs_capture"][0]["path"])
    assert path.parent == cap and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cap.stat().st_mode) == 0o700
    path.unlink()
    # the server's own warm-up and requests without the client prefix are not captured
    body["rid"] = "someone-else"
    meta = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(
                f"{server.url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            ),
            timeout=120,
        ).read()
    )["meta_info"]
    assert meta.get("hs_capture") in (None, [None])  # no capture asked, none made
    client(smollm2, server).extract(random_samples(6, 20000, 5, 60, seed=8))
    assert list(cap.iterdir()) == []  # every capture deleted once stored, no temp file left


def test_custom_taps_follow_sglang_id_rule(smollm2, tmp_path):
    """Our tap j (input of layer j) must reach SGLang as id j-1: checked against HF on the same taps."""
    taps = [3, 10, 20]
    srv = start(smollm2, tmp_path, taps=taps)
    try:
        seqs = random_samples(3, 20000, 20, 120, seed=4)
        got = client(smollm2, srv, taps=taps).extract(seqs)
        hf = HFBackend(smollm2, taps, dtype=CPU_DTYPE, device="cpu").extract(seqs)
        for (a, f), (ra, rf) in zip(got, hf):
            assert cosine(a, ra).mean() > 0.999 and cosine(f, rf).mean() > 0.999
        with pytest.raises(SampleFailed, match="server captures taps"):
            client(smollm2, srv, retries=0).extract(seqs[:1])  # default taps asked of a [3, 10, 20] server
    finally:
        srv.stop()


def test_forced_past_launcher_every_affected_sample_is_caught(smollm2, tmp_path):
    srv = start(smollm2, tmp_path, extra=["--chunked-prefill-size", "64"], raw=True)  # radix cache on too
    try:
        sg = client(smollm2, srv, retries=0)
        longs = random_samples(4, 20000, 100, 300, seed=9)
        for seq in longs:  # chunked: fewer positions captured while cached_tokens == 0
            with pytest.raises(SampleFailed, match="captured .* positions"):
                sg.extract([seq])
        shorts = random_samples(4, 20000, 10, 50, seed=10)
        for seq in shorts:
            sg.extract([seq])  # the first time nothing is cached: a complete capture
            with pytest.raises(SampleFailed, match="cached_tokens="):
                sg.extract([seq])  # the repeat hits the radix cache
        assert list((tmp_path / "capture").iterdir()) == []  # rejected captures are deleted too
    finally:
        srv.stop()


def test_server_killed_mid_extraction_then_dvc_repro_resumes(tmp_path):
    params = tiny_params(parts=("tiny-a",), per_part=24)  # the built-in target: its path is in the clone
    params["store"].update(chunk_mb=0.05, shard_mb=0.5)
    # one sample a batch and windows of ~10 samples: pieces commit one by one while the server runs
    params["extract"].update(backend="sglang", device="cpu", batch_tokens=256)
    params["extract"]["sglang"].update(python=str(SGPY), concurrency=1, retries=1)
    repo = make_clone(tmp_path / "repo", params)
    sh("dvc repro -q tokenize@tiny-a", repo)
    proc = subprocess.Popen(
        f"{Path(sys.executable).parent}/dvc repro extract@tiny-a",
        cwd=repo,
        shell=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    work = repo / ".eaglenest" / "work"
    t0 = time.time()
    while not list(work.glob("*/pieces/*.json")):  # wait for the first committed piece
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() - t0 < 600
        time.sleep(0.05)
    pids = subprocess.run(
        ["pgrep", "-f", f"sglang.launch_server.*{repo}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "the stage's server process"
    for pid in pids:
        os.killpg(int(pid), signal.SIGKILL)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    assert "SGLang server exited" in out and "log" in out, out[-3000:]
    assert not (repo / "data/hidden/tiny-a").exists()
    committed = len(list(work.glob("*/pieces/*.json")))
    assert committed >= 1

    sh("dvc repro extract@tiny-a", repo)
    m = json.loads((repo / "reports/extract/tiny-a.json").read_text())
    run = json.loads((repo / "reports/timing/extract/tiny-a.json").read_text())
    assert m["committed"] and run["pieces_resumed"] >= 1 and run["pieces_resumed"] < m["pieces"]
    assert HiddenStore(repo / "data/hidden/tiny-a").attrs["extractor"]["backend"] == "sglang"
    assert not subprocess.run(
        ["pgrep", "-f", f"sglang.launch_server.*{repo}"], capture_output=True, text=True
    ).stdout.strip(), "the stage stops the server it launched"


def test_a_deepseek_v3_target_served_by_sglang_passes_the_gate(smollm2, tmp_path):
    """The architecture these users extract with the engine they use: a random DeepSeek-V3 (MLA with a q
    LoRA and YaRN rope, shared and routed experts, group-limited sigmoid routing, a dense first layer)
    served by SGLang on the CPU with the capture plugin, through the part's gate under the MoE policy.
    Taps from layer 1 take the plugin's path for DeepSeek's own id rule (ids as given unless the first
    is 1); MLA's prefill runs on the attention backend that takes its keys as computed."""
    from eaglenest.target.directory import materialize
    from eaglenest.target.random_weights import build

    from .conftest import gate

    build("deepseek-v3", tmp_path / "model", smollm2.model_dir)
    target = materialize(str(tmp_path / "model"), tmp_path / "target")
    taps, cap = [1, 3, 4], tmp_path / "capture"
    cap.mkdir(mode=0o700)
    srv = LaunchedServer(SGPY, target.model_dir, dtype=CPU_DTYPE, taps=taps, capture_dir=cap, device="cpu",
                         extra_args=["--max-total-tokens", "16384"], log_path=tmp_path / "server.log",
                         startup_timeout=300)  # fmt: skip
    with srv:
        backend = SGLangBackend(target, taps, dtype=CPU_DTYPE, device="cpu", server_url=srv.url, capture_dir=str(cap))
        m = extract_part(
            part="p",
            tokenized=write_tokenized(tmp_path / "p.parquet", random_samples(12, 20000, 40, 120, seed=5)),
            target=target,
            backend=backend,
            taps=taps,
            dtype=CPU_DTYPE,
            revision=0,
            layout_cfg=dict(chunk_mb=0.05, shard_mb=0.5, codec="zstd", level=1),
            validate_cfg=gate(6),
            out_dir=tmp_path / "hidden",
            work_root=tmp_path / "work",
            batch_tokens=512,
            max_seq_len=128,
            progress=False,
        )
        backend.close()
    assert "--prefill-attention-backend intel_amx" in (tmp_path / "server.log").read_text()  # the launcher says
    v = m["validation"]
    assert v["passed"], v["failures"]
    assert v["thresholds"]["token_quantile"] == 0.98 and v["reference"]["routing"]["routers"] == 5  # the MoE policy
    assert v["reference"]["routing"]["chosen_by"]["reference_bf16"] == 6  # an engine's experts are not captured
    assert HiddenStore(tmp_path / "hidden").attrs["extractor"]["backend"] == "sglang"
