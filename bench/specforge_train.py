"""SpecForge 0.2.0's EAGLE-3 model and loss, trained to the end on eaglenest's packed data by
eaglenest's data loader, optimizer and schedule, then evaluated by eaglenest's `evaluate` stage
(bench/RESULTS.md, "SpecForge side by side"). Run it in a workspace where `dvc repro`
has run (data/packed, data/target), e.g. the GPU profile's ~/run:

    python -m bench.specforge_train [--workdir ~/run] [-S train.epochs=5 ...] [--out DIR] [--skip-eval]

SpecForge's: `LlamaForCausalLMEagle3` (its drafter, flex attention) and `OnlineEagle3Model` (its
training-time test and loss: soft targets from the target head over the draft vocabulary, computed
from the final hidden states in chunks, its "compact teacher"), loss = sum_k decay^k ploss_k, and its
input conventions (`TargetHead.preprocess`: ids and teacher states shifted left by one, loss mask per
input token). eaglenest's: the batches (the same samples, order and padded shapes as the `train`
stage), the initial weights (copied from eaglenest's drafter at the same seed: lm_head and norm from
the target), AdamW with the same lr, warmup, cosine schedule and clip, bf16 autocast over fp32
weights, checkpoints (SIGINT saves one; the same command resumes). The validation figures are
eaglenest's TTT evaluation of SpecForge's weights. At the end the weights go into eaglenest's
`Eagle3Drafter` (the parameter names are the same), `save_pretrained` writes DIR/drafter, and
`python -m stages.evaluate --drafter DIR/drafter` measures tau; its metrics are kept in DIR and the
workspace's own evaluate outputs (metrics/, reports/) are put back.

SpecForge is no dependency of eaglenest: install its wheel with --no-deps; it imports triton, so it
runs on CUDA only.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


EVALUATE_OUTPUTS = (  # what the evaluate stage writes (stages/evaluate.py)
    "metrics/evaluate.json",
    "metrics/evaluate_positions.csv",
    "reports/evaluate.json",
    "reports/evaluate_questions.json",
    "reports/timing/evaluate.json",
)


def specforge_trainer(packed: Path, target, cfg, ckpt_dir: Path, attention: str = "flex_attention"):
    """An eaglenest Trainer whose step trains SpecForge's model with SpecForge's loss (`attention`: its
    backend; flex_attention, as SpecForge trains, has no backward on the CPU: sdpa there)."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.utils import padding
    from transformers import LlamaConfig

    from eaglenest.drafter import checkpoint
    from eaglenest.drafter.train import Trainer
    from eaglenest.target.loading import load_heads

    class SpecForgeTrainer(Trainer):
        def __init__(self):
            super().__init__(packed, Path("data/hidden"), target, cfg, ckpt_dir)
            tcfg = json.loads((target.model_dir / "config.json").read_text())
            scfg = LlamaConfig(**{**tcfg, "num_hidden_layers": 1})
            scfg.intermediate_size = cfg.intermediate_size or tcfg["intermediate_size"]
            scfg.draft_vocab_size = self.head_sel.shape[0]
            scfg.target_hidden_size = tcfg["hidden_size"]
            torch.manual_seed(cfg.seed)
            sf = LlamaForCausalLMEagle3(scfg, attention_backend=attention)
            # eaglenest's initial weights (the names match; t2d / d2t included), the target's embedding
            missing, unexpected = sf.load_state_dict(self.model.state_dict(), strict=False)
            self.weights_not_shared = {"missing": missing, "unexpected": unexpected}
            if [m for m in missing if m != "embed_tokens.weight"] or unexpected:
                raise SystemExit(f"SpecForge's drafter and eaglenest's differ: {self.weights_not_shared}")
            with torch.no_grad():
                sf.embed_tokens.weight.copy_(self.embed.weight.float())
            sf.embed_tokens.weight.requires_grad_(False)
            self.sf = sf.to(self.device)
            self.sf_model = OnlineEagle3Model(self.sf, length=self.K, attention_backend=attention)
            self.head_full = load_heads(target)["lm_head"].to(self.device, torch.bfloat16)
            # eaglenest's optimizer and schedule, over SpecForge's parameters
            self.opt = torch.optim.AdamW(
                [p for p in self.sf.parameters() if p.requires_grad],
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                betas=(0.9, 0.95),
                fused=self.device.type == "cuda",
            )
            lam = self.sched.lr_lambdas[0]
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lam)

        @property
        def ckpt_path(self) -> Path:  # never eaglenest's own checkpoint of the same config
            return self.ckpt_dir / f"specforge-{self.key}.pt"

        def save_checkpoint(self) -> None:
            checkpoint.save(self.ckpt_path, self.sf, self.opt, self.sched, self.state)

        def maybe_resume(self) -> bool:
            if not self.ckpt_path.is_file():
                return False
            self.state = checkpoint.load(self.ckpt_path, self.device, self.sf, self.opt, self.sched)
            print(f"resumed from {self.ckpt_path} at epoch {self.state['epoch']} step {self.state['step_in_epoch']}")
            return True

        def train_step(self, micro, loaded=None) -> torch.Tensor:
            _, batches = loaded or self.load_step(micro)
            stats = torch.zeros(self.K, 3, device=self.device)
            self.opt.zero_grad(set_to_none=True)
            for mb, b in zip(micro, batches):
                b = self._to_dev(b)
                B, T = b["input_ids"].shape
                n = torch.tensor([self.train_split.length(i) for i in mb] + [1] * (B - len(mb)), device=self.device)
                attention_mask = (torch.arange(T, device=self.device)[None] < n[:, None]).long()  # no empty row
                with self.autocast:
                    plosses, _, _, corrects, denoms, *_ = self.sf_model(
                        input_ids=padding(b["input_ids"], left=False),
                        attention_mask=attention_mask,
                        target=None,
                        loss_mask=b["loss_mask"][..., None],
                        hidden_states=b["aux"].flatten(-2),
                        target_hidden_for_compact=padding(b["final"], left=False).to(torch.bfloat16),
                        target_head_weight=self.head_full,
                    )
                    loss = sum(self.cfg.decay**k * p for k, p in enumerate(plosses))
                (loss / len(batches)).backward()
                for k in range(self.K):  # eaglenest's stats per step: CE sum (its loss: sum / B T), correct, count
                    d = torch.as_tensor(denoms[k], device=self.device).float()
                    ce = plosses[k].detach().float() * B * T
                    stats[k] += torch.stack([ce, torch.as_tensor(corrects[k], device=self.device).float(), d])
            torch.nn.utils.clip_grad_norm_(self.sf.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.sched.step()
            return stats

        def to_eaglenest(self) -> None:
            """SpecForge's weights into eaglenest's drafter (validation, export)."""
            own = self.model.state_dict()
            self.model.load_state_dict({k: v for k, v in self.sf.state_dict().items() if k in own}, strict=False)

        @torch.no_grad()
        def evaluate(self) -> dict:
            self.to_eaglenest()
            return super().evaluate()

    if cfg.micro_batches != 1 or int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("bench.specforge_train: one process, train.micro_batches 1")
    return SpecForgeTrainer()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path.home() / "run")
    ap.add_argument("-S", dest="sets", action="append", default=[], help="train.key=value over the workspace's params")
    ap.add_argument("--out", type=Path, default=None, help="default: <workdir>/bench/out/specforge")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--attention", default="flex_attention", help="SpecForge's backend (sdpa: a check on the CPU)")
    a = ap.parse_args()
    os.chdir(a.workdir)
    sys.path.insert(0, str(REPO))
    import yaml

    from eaglenest.drafter.train_config import TrainConfig
    from eaglenest.target.directory import load_target
    from stages import _paths as paths

    out = a.out or a.workdir / "bench" / "out" / "specforge"
    out.mkdir(parents=True, exist_ok=True)
    p = yaml.safe_load(Path("params.yaml").read_text())["train"]
    for s in a.sets:  # train.key=value
        key, value = s.split("=", 1)
        section, name = key.split(".", 1)
        if section != "train" or name not in p:
            raise SystemExit(f"-S {s}: only train.<key> of params.yaml")
        p[name] = yaml.safe_load(value)
    cfg = TrainConfig.from_params(p)
    trainer = specforge_trainer(
        Path("data/packed"), load_target(Path("data/target")), cfg, paths.TRAIN_CKPT, a.attention
    )
    t = time.time()
    result = trainer.fit()
    trainer.to_eaglenest()
    trainer.model.save_pretrained(out / "drafter")
    last = result["epochs"][-1]
    res = {
        "model_and_loss": "SpecForge 0.2.0 LlamaForCausalLMEagle3 + OnlineEagle3Model (compact teacher)",
        "train": {"sets": a.sets, "epochs": len(result["epochs"]), "steps": trainer.state["global_step"],
                  "wall_s": round(time.time() - t, 1), "tokens_per_s": result["tokens_per_s"],
                  "train_loss": last["train"]["loss"], "val_loss": last["val"]["loss"],
                  "val_acc_per_step": last["val"]["acc_per_step"], "val_simulated_tau": last["val"]["simulated_tau"]},
        "weights_not_shared": trainer.weights_not_shared,
    }  # fmt: skip
    (out / "specforge.json").write_text(json.dumps(res, indent=1))
    if not a.skip_eval:
        outputs = [Path(f) for f in EVALUATE_OUTPUTS]
        kept = {f: f.read_bytes() for f in outputs if f.exists()}  # the workspace's own, put back after
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "stages.evaluate", "--drafter", str(out / "drafter"), "--no-progress"]
        r = subprocess.run(cmd, env=env)
        res["evaluate_exit"] = r.returncode  # non-zero also when tau is under evaluate.min_tau
        if Path("reports/evaluate.json").exists():
            ev = json.loads(Path("reports/evaluate.json").read_text())
            res["evaluate"] = {k: ev.get(k) for k in ("tau", "accept_rate_per_position", "identical_to_greedy")}
            for f in outputs:
                if f.exists():
                    shutil.copy(f, out / f.name.replace(".json", f"_{f.parent.name}.json"))
        for f, data in kept.items():
            f.write_bytes(data)
        (out / "specforge.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
