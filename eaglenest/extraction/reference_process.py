"""The validation gate's float32 reference in a process of its own, started with the part: it loads the
reference and takes the gate's samples' states while the extraction loads and compiles (a GPU idles
then), frees the model but its lm_head, and once the part's store is complete compares the stored
states with them (`gate.run_gate`) and sends back the figures. A process of its own because in the
extracting one the reference could run beside neither the own layer's compile (fx's tracing patches
`nn.Module` for every thread) nor the forward loop (on the H200 a 2.6M-token part's loop lost 6.9 s to
the reference loading beside it: one GIL); after the loop it would cost its load (~5.5 s) on top of
the comparison.
The reference is the same independent model (transformers, float32, eager, one sample at a time);
the samples are the seeded choice the gate always made. On the CPU the reference runs in the
extracting process, after the loop (`LocalReference`): there it has no compile or launch-bound loop
to stay clear of, and a second process's start, imports and load only compete with the extraction
for the same cores. A mixture of experts whose extraction keeps its own routing for the gate's samples
(`routing.Capture`): the process loads while the part runs, and takes the states as soon as the
extraction has run the gate's samples (their windows go first) and hands their experts over."""

import logging
import multiprocessing
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.directory import Target, model_config

log = logging.getLogger(__name__)


def choose(n_samples: int, want: int, seed: int) -> list[int]:
    """The gate's samples: a seeded choice among the part's, in the part's order."""
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n_samples, size=min(want, n_samples), replace=False).tolist())


def start_reference(
    target: Target,
    taps: list[int],
    device: str,
    tokenized: Path,
    chosen: list[int],
    streamed: bool,
    replay: bool,
    captured: bool = False,
):
    """The gate's reference for a part extracted on `device`: a process of its own on an accelerator,
    in this process on the CPU (module docstring); streamed or whole (`reference.choose_streamed`);
    replaying a bf16 forward's experts or not (`gate.replays_routing`). `captured`: the extraction
    keeps its own forward's experts for the gate's samples; the comparison then takes them, and the
    reference's states wait for them."""
    if device == "cpu":
        return LocalReference(target, taps, device, tokenized, chosen, streamed, replay)
    return ReferenceProcess(target, taps, device, tokenized, chosen, streamed, replay, captured)


class LocalReference:
    """The same interface in this process: `compare` loads the reference and compares."""

    def __init__(
        self,
        target: Target,
        taps: list[int],
        device: str,
        tokenized: Path,
        chosen: list[int],
        streamed: bool = False,
        replay: bool = False,
    ):
        self.target, self.taps, self.device, self.chosen = target, list(taps), device, chosen
        self.streamed, self.replay = streamed, replay

    def compare(self, store: Path, thresholds: dict, routing: dict | None = None) -> tuple[dict, bool]:
        """`routing`: the experts the extraction's forward chose for the chosen samples (`routing.Capture`)."""
        from eaglenest.extraction.reference import Reference

        t = time.perf_counter()
        ref = Reference(self.target, self.taps, self.device, self.streamed, self.replay)
        if routing:
            ref.take_routing(routing)
        load_s = time.perf_counter() - t
        metrics, passed = _compare(ref, store, self.chosen, thresholds, model_config(self.target))
        # here the states are taken in the comparison: `seconds_by_step.reference_s`
        metrics.update(reference_load_s=round(load_s, 2), reference_states_s=0.0)
        return metrics, passed

    def take_routing(self, chosen: dict) -> None:
        """Nothing ahead: here the comparison takes the experts and the states."""

    def close(self) -> None:
        pass


class ReferenceProcess:
    """Starts the process; `compare` hands it the complete store and returns (metrics, passed);
    `close` ends it, whatever happened."""

    def __init__(
        self,
        target: Target,
        taps: list[int],
        device: str,
        tokenized: Path,
        chosen: list[int],
        streamed: bool = False,
        replay: bool = False,
        captured: bool = False,
    ):
        self.chosen = chosen
        self.ready = None  # what the process reports once its states are taken
        self.sending = None  # the thread handing over the experts ahead of the comparison (`take_routing`)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
        self.conn, child = ctx.Pipe()
        job = (target, list(taps), device, str(tokenized), chosen, streamed, replay, captured, os.getpid())
        self.proc = ctx.Process(target=_serve, args=(job, child), name="gate-reference", daemon=True)
        self.proc.start()
        child.close()

    def _recv(self, what: str):
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join()
            raise EaglenestError(f"validation gate: the reference process died ({what}; exit code "
                                 f"{self.proc.exitcode}); nothing committed") from None  # fmt: skip
        if "error" in msg:
            log.error("validation gate: the reference process failed:\n%s", msg["traceback"])
            raise EaglenestError(f"validation gate: the reference failed ({what}): {msg['error']}; nothing committed")
        return msg

    def take_routing(self, chosen: dict) -> None:
        """The experts the extraction's forward chose for the chosen samples (`routing.Capture`), as soon
        as it has them: the process takes its states from them while the part runs on. Sent from a
        thread: the process may still be loading, and a pipe holds less than the experts."""
        if self.sending is None:
            msg = {"routing": _by_value(chosen)}
            self.sending = threading.Thread(target=self._send, args=(msg,), name="gate-routing")
            self.sending.start()

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):  # the process died: `compare` says so
            pass

    def compare(self, store: Path, thresholds: dict, routing: dict | None = None) -> tuple[dict, bool]:
        """Waits for the reference's states (or its load, where they wait for the experts), then has the
        process compare the store's samples. `routing`: the experts, where `take_routing` did not
        hand them over ahead."""
        t = time.perf_counter()
        self.ready = self._recv("loading the float32 reference")
        if self.sending is not None:  # the experts went ahead: their states come next
            self.sending.join()
            self.ready |= self._recv("taking the reference's states")
            routing = None
        waited = time.perf_counter() - t
        self.conn.send({"compare": (str(store), thresholds, _by_value(routing or {}))})
        metrics, passed = self._recv("comparing")["result"]
        metrics["reference_wait_s"] = round(waited, 2)  # what the part waited for the states, if anything
        metrics.update(self.ready)
        return metrics, passed

    def close(self) -> None:
        if self.sending is not None:  # never two writers on the pipe
            self.sending.join()
        self._send(None)  # no comparison (a failed run): the process ends
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _by_value(chosen: dict) -> dict:
    """Experts per sample as numpy arrays: pickled by value, not through shared memory."""
    return {k: [c.numpy() for c in v] for k, v in chosen.items()}


def _compare(ref, store: Path, chosen: list[int], cfg: dict, target_config: dict) -> tuple[dict, bool]:
    """The chosen samples of the complete store against the reference (freed after), under the limits
    of params `validate` (`cfg`) for this target."""
    from eaglenest.extraction.gate import run_gate, thresholds_for
    from eaglenest.store.bf16 import from_bits
    from eaglenest.store.hidden_store import HiddenStore

    store = HiddenStore(Path(store), check_metadata=False)

    def read(i):
        ids, aux, final = store.read(i)
        return ids, from_bits(aux), from_bits(final)

    # all samples read (decoded, digests checked) at once, each in a thread: the comparison of the
    # first overlaps the reading of the rest
    with ThreadPoolExecutor(max(1, min(8, len(chosen))), thread_name_prefix="gate-read") as pool, ref:
        reads = {i: pool.submit(read, i) for i in chosen}
        memory = None
        if ref.model is not None:  # states not taken ahead (the CPU): all together now (streamed: one
            ref.precompute([reads[i].result()[0] for i in chosen])  # read of the weights for all)
            memory = ref.memory()
        metrics, passed = run_gate(lambda i: reads[i].result(), chosen, ref, thresholds_for(cfg, target_config))
    if memory is not None:
        metrics["reference"] = memory
    return metrics, passed


def _serve(job, conn) -> None:
    target, taps, device, tokenized, chosen, streamed, replay, captured, parent = job

    def watch():  # ends with the extraction, whatever ended it
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    try:
        from eaglenest.extraction.plan import read_tokenized
        from eaglenest.extraction.reference import Reference

        t = time.perf_counter()
        ref = Reference(target, taps, device, streamed, replay)
        ready = {"reference_load_s": round(time.perf_counter() - t, 2)}

        def states() -> dict:  # the chosen samples' states, then only the head kept
            t = time.perf_counter()
            ref.precompute([seqs[i] for i in chosen])
            figures = {"reference": ref.memory()}
            ref.keep_head_only()
            return figures | {"reference_states_s": round(time.perf_counter() - t, 2)}

        seqs = read_tokenized(Path(tokenized))[1]
        if not captured:  # now, while the extraction loads and compiles
            ready |= states()
        conn.send(ready)
        msg = conn.recv()
        if msg is not None and "routing" in msg:  # the extraction's experts, while its part runs on
            ref.take_routing(msg["routing"])
            conn.send(states())
            msg = conn.recv()
        if msg is not None:
            store, thresholds, routing = msg["compare"]
            if routing:
                ref.take_routing(routing)
            conn.send({"result": _compare(ref, Path(store), chosen, thresholds, model_config(target))})
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
