"""Train an EAGLE-3 drafter on pack's split and the stores' states (docs/design.md: Drafter and training):
TTT loss, AdamW, warmup + cosine, grad clip, bf16 autocast, exact resume, DDP under torchrun (gloo on
CPU, NCCL on CUDA).

A global step consumes `micro_batches` micro-batches; rank r of W takes every W-th of them, so
any world size sees the same global batch and — with losses normalised by the global masked-token
count — the same gradient."""

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from eaglenest.data.loader import BatchLoader
from eaglenest.data.packed import PackedSplit, bucket_width, load_vocab
from eaglenest.drafter import checkpoint
from eaglenest.drafter.acceptance import summarize
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.feeding import BatchFeeding
from eaglenest.drafter.model import Eagle3Drafter, FrozenEmbedding
from eaglenest.drafter.train_config import TrainConfig, training_code_digest
from eaglenest.drafter.ttt import Recipe, ttt_loss
from eaglenest.files.hashing import sha256_text
from eaglenest.runtime import host_memory
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.made_on import compute_dtype
from eaglenest.target.directory import Target, model_config
from eaglenest.target.loading import load_heads

log = logging.getLogger(__name__)


class Trainer(BatchFeeding):
    def __init__(self, packed: Path, stores: Path, target: Target, cfg: TrainConfig, ckpt_dir: Path):
        """packed: pack's output; stores: the directory of the parts' stores (data/hidden)."""
        self.cfg, self.ckpt_dir = cfg, Path(ckpt_dir)
        self.packed, self.stores = Path(packed), Path(stores)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if dev == "cuda" and self.world > 1:
            dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(dev)
        self.device = torch.device(dev)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.train_split, self.val_split = PackedSplit(packed, "train", stores), PackedSplit(packed, "val", stores)
        self.splits = {"train": self.train_split, "val": self.val_split}
        self.loader = BatchLoader(self.packed, self.stores, self.splits, 0)  # `fit` starts its workers
        self.threads, self.ahead = None, 1  # `fit`'s loading threads and how many steps they run ahead
        man = self.train_split.manifest
        if man["target_fingerprint"] != target.fingerprint:
            raise EaglenestError(
                f"{packed}: packed for target {man['target_fingerprint'][:16]}, not {target.fingerprint[:16]}"
            )
        vocab = load_vocab(packed)
        heads = load_heads(target)
        tcfg = model_config(target)
        dcfg = DrafterConfig.from_target(tcfg, int(man["draft_vocab_size"]), man["taps"], cfg.intermediate_size)
        torch.manual_seed(cfg.seed)
        model = Eagle3Drafter(dcfg)
        model.set_vocab(vocab["selected"])
        with torch.no_grad():  # start from the target's own output head and norm (speeds up learning)
            model.lm_head.weight.copy_(heads["lm_head"][vocab["selected"]].float())
            if heads["final_norm"] is not None:
                model.norm.weight.copy_(heads["final_norm"].float())
        self.model = model.to(self.device)
        attention = cfg.attention if cfg.attention != "auto" else ("flex" if self.device.type == "cuda" else "eager")
        self.model.set_attention(attention)
        compile_on = {"auto": self.device.type == "cuda", "true": True, "false": False}.get(str(cfg.compile).lower())
        if compile_on is None:
            raise EaglenestError(f"train.compile must be auto, true or false, got {cfg.compile!r}")
        if compile_on:
            self.model.compile_blocks()
        # the flex kernel is compiled for fixed shapes (attention.py): batches of a few fixed
        # shapes, or every new (rows, length) recompiles until torch falls back to the eager
        # kernel (25x slower on short-sample data, measured on an H200)
        self.longest = max(s.length(i) for s in (self.train_split, self.val_split) for i in range(len(s)))
        self.bucket = bucket_width(self.longest) if attention == "flex" and self.device.type == "cuda" else 0
        self.embed = FrozenEmbedding(heads["embed"]).to(self.device)
        self.head_sel = heads["lm_head"][vocab["selected"]].to(self.device)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model
        self.K = cfg.ttt_steps
        self.recipe = Recipe(cfg.topk, cfg.topk_weight, cfg.align_topk)
        if cfg.micro_batches % self.world:
            raise EaglenestError(
                f"train.micro_batches {cfg.micro_batches} must be a multiple of the world size {self.world}"
            )
        self.steps_per_epoch = len(self.batches(self.train_split, 0)) // cfg.micro_batches
        if self.steps_per_epoch == 0:
            raise EaglenestError(f"too little training data for one step of {cfg.micro_batches} micro-batches")
        self.total_steps = self.steps_per_epoch * cfg.epochs
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=fused
        )
        warm = max(1, int(cfg.warmup * self.total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / self.total_steps))),
        )
        # auto: bf16 on a GPU or a CPU with bf16 units; a CPU that emulates bf16 trains faster in float32
        use_bf16 = cfg.autocast == "bf16" or (
            cfg.autocast == "auto" and compute_dtype("auto", str(self.device)) == "bfloat16"
        )
        self.compute_dtype = "bfloat16" if use_bf16 else "float32"
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        # the training code is part of the key: a checkpoint written by other code (a DVC rerun
        # after a code change) is never resumed as if it were this run
        self.key = sha256_text(
            json.dumps(asdict(cfg), sort_keys=True),
            man["target_fingerprint"],
            json.dumps([man["stores"], man["splits"]], sort_keys=True),
            str(self.world),
            training_code_digest(),
        )[:16]
        self.state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "history": [], "epochs": []}

    # --- checkpoints --------------------------------------------------------------------------
    @property
    def ckpt_path(self) -> Path:
        return self.ckpt_dir / f"last-{self.key}.pt"

    def save_checkpoint(self) -> None:
        if self.rank == 0:
            checkpoint.save(self.ckpt_path, self.model, self.opt, self.sched, self.state)

    def maybe_resume(self) -> bool:
        if not self.ckpt_path.is_file():
            others = sorted(p.name for p in self.ckpt_dir.glob("last-*.pt")) if self.ckpt_dir.is_dir() else []
            if others and self.rank == 0:
                log.info(
                    "not resuming %s (other config, data or training code); delete to free disk: %s",
                    ", ".join(others),
                    self.ckpt_dir,
                )
            return False
        self.state = checkpoint.load(self.ckpt_path, self.device, self.model, self.opt, self.sched)
        log.info(
            "resumed from %s at epoch %d step %d", self.ckpt_path, self.state["epoch"], self.state["step_in_epoch"]
        )
        return True

    def train_step(self, micro: list[list[int]], loaded: tuple | None = None) -> torch.Tensor:
        denom, batches = loaded or self.load_step(micro)
        stats = torch.zeros(self.K, 3, device=self.device)
        self.opt.zero_grad(set_to_none=True)
        for j, b in enumerate(batches):
            sync = j == len(batches) - 1
            ctx = self.ddp.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                with self.autocast:
                    loss, st = ttt_loss(
                        self.ddp,
                        self._to_dev(b),
                        self.embed,
                        self.head_sel,
                        self.K,
                        denom,
                        self.cfg.decay,
                        recipe=self.recipe,
                    )
                (loss * self.world).backward()  # DDP averages over ranks; the loss is a global sum
            stats += st.float()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        if self.world > 1:
            dist.all_reduce(stats)
        return stats

    @torch.no_grad()
    def evaluate(self) -> dict:
        stats = torch.zeros(self.K, 3, device=self.device)
        mine = self.batches(self.val_split, 0)[self.rank :: self.world]
        for _, (b,) in self.prefetched(mine, self.threads, self.ahead, lambda mb: self.fetch([mb], "val")):
            with self.autocast:
                _, st = ttt_loss(
                    self.model,
                    self._to_dev(b),
                    self.embed,
                    self.head_sel,
                    self.K,
                    [1.0] * self.K,
                    self.cfg.decay,
                )
            stats += st.float()
        if self.world > 1:
            dist.all_reduce(stats)
        return summarize(stats)

    def fit(self, on_epoch=None, stop_after_steps: int | None = None, progress: bool = True) -> dict:
        from tqdm import tqdm

        self.maybe_resume()
        bar = tqdm(
            total=self.total_steps,
            initial=self.state["global_step"],
            unit="step",
            desc="train",
            disable=not progress or self.rank != 0,
        )
        loader = ThreadPoolExecutor(self.start_loader(self.cfg.loader_workers), thread_name_prefix="batch-loader")
        self.threads = loader
        if not self.loader.pool:  # read here: the states once a run if they fit a quarter of the free memory
            for split in (self.train_split, self.val_split):
                split.keep_in_memory(host_memory.available() // 4)
        try:
            with self.checkpoint_on_interrupt():
                return self._fit(on_epoch, stop_after_steps, bar, loader)
        finally:
            loader.shutdown(wait=True, cancel_futures=True)
            self.loader.close()
            self.threads = None

    @contextlib.contextmanager
    def checkpoint_on_interrupt(self):
        """Ctrl-C, SIGTERM or SIGHUP (DVC, a job time limit, a closed terminal) finishes the running step,
        saves a checkpoint and then stops: the next run resumes there, not at the last `ckpt_every`.
        One process only: under DDP the ranks would have to agree on the step, so there the signal
        stops at once as before."""
        self.interrupted = None
        if self.world > 1 or threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum, frame):
            if self.interrupted is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self.interrupted = signal.Signals(signum).name
            log.warning("%s: finishing this step, then saving a checkpoint (again to stop at once)", self.interrupted)

        old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _fit(self, on_epoch, stop_after_steps, bar, loader) -> dict:
        t0, tokens = time.time(), 0
        while self.state["epoch"] < self.cfg.epochs:
            ep = self.state["epoch"]
            batches = self.batches(self.train_split, ep)
            M = self.cfg.micro_batches  # an incomplete tail step is dropped: every world size sees the same steps
            steps = [batches[i : i + M] for i in range(0, len(batches) - M + 1, M)]
            ep_stats = torch.zeros(self.K, 3, device=self.device)
            first = self.state["step_in_epoch"]
            for s, (micro, loaded) in enumerate(self.prefetched(steps[first:], loader, self.ahead), start=first):
                st = self.train_step(micro, loaded)
                ep_stats += st
                tokens += sum(self.train_split.length(i) for mb in micro for i in mb)
                loss = float(sum((self.cfg.decay**k) * st[k, 0] / max(1.0, float(st[k, 2])) for k in range(self.K)))
                self.state["history"].append(
                    {"step": self.state["global_step"], "loss": loss, "lr": self.sched.get_last_lr()[0]}
                )
                self.state["global_step"] += 1
                self.state["step_in_epoch"] = s + 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}")
                if self.state["global_step"] % self.cfg.ckpt_every == 0:
                    self.save_checkpoint()
                if self.interrupted:
                    self.save_checkpoint()
                    bar.close()
                    raise EaglenestError(
                        f"training interrupted ({self.interrupted}) at step {self.state['global_step']}; "
                        f"checkpoint saved to {self.ckpt_path}: run again to resume"
                    )
                if stop_after_steps is not None and self.state["global_step"] >= stop_after_steps:
                    self.save_checkpoint()
                    bar.close()
                    return {"stopped_at": self.state["global_step"]}
            summary = {"epoch": ep, "train": summarize(ep_stats), "val": self.evaluate()}
            self.state["epochs"].append(summary)
            self.state["epoch"], self.state["step_in_epoch"] = ep + 1, 0
            self.save_checkpoint()
            if on_epoch and self.rank == 0:
                on_epoch(summary)
        bar.close()
        elapsed = time.time() - t0
        return {
            "epochs": self.state["epochs"],
            "history": self.state["history"],
            "tokens_per_s": round(tokens / elapsed, 1) if tokens else None,
            "wall_s": round(elapsed, 2),
            "world_size": self.world,
        }
