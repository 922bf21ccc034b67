"""Stage `train`: the EAGLE-3 drafter on data/packed (the split and tokens) and data/hidden (the states,
read from the stores), exported to data/drafter in the serving format.

    python -m stages.train                                   (train.nproc ranks: auto = one per GPU)
    torchrun --nproc-per-node 2 -m stages.train              (by hand: DDP, gloo on CPU, NCCL on GPU)
With train.nproc above 1 (auto: every GPU that train.micro_batches splits over), the stage starts
itself again under torchrun, so `dvc repro` trains with DDP on every GPU of the host.
params: train.* (epochs, lr, warmup, ttt_steps, batch_tokens, micro_batches, nproc, ...). Checkpoints
go to .eaglenest/train/ (outside DVC outputs); a rerun with the same config resumes exactly.
dvclive logs per-epoch loss, accuracy per TTT step and simulated acceptance length. Writes
metrics/train.json (validation loss and simulated tau), reports/train.json (every figure) and
reports/timing/train.json (tokens/s).
"""

import argparse
import logging
import sys
from pathlib import Path

from eaglenest.drafter.train import Trainer
from eaglenest.drafter.train_config import TrainConfig
from eaglenest.files.atomic import replaced_dir, write_json
from eaglenest.runtime.errors import exit_on_error
from eaglenest.runtime.made_on import made_on
from eaglenest.runtime.torchrun import ranks, relaunch, under_torchrun, visible_gpus
from eaglenest.target.directory import load_target

from . import _params
from . import _paths as paths

log = logging.getLogger("eaglenest.train")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stop-after-steps", type=int, help="stop (checkpointed) after N global steps; for tests")
    ap.add_argument("--out", default=str(paths.DRAFTER))
    ap.add_argument("--metrics", default=str(paths.metrics("train")), help="headline figures (default: %(default)s)")
    ap.add_argument("--report", default=str(paths.report("train")), help="every figure (default: %(default)s)")
    ap.add_argument("--timing", default=str(paths.timing("train")), help="the run's clock (default: %(default)s)")
    ap.add_argument("--ckpt-dir", default=str(paths.TRAIN_CKPT))
    args = ap.parse_args(argv)
    p = _params.load("train")
    cfg = TrainConfig.from_params(p)
    if not under_torchrun():
        n = ranks(cfg.nproc, cfg.micro_batches, visible_gpus(cfg.device))
        if n > 1:
            log.info("training on %d ranks under torchrun (train.nproc %s)", n, cfg.nproc)
            sys.exit(relaunch(n, "stages.train", sys.argv[1:] if argv is None else argv))
    trainer = Trainer(paths.PACKED, paths.HIDDEN, load_target(paths.TARGET), cfg, Path(args.ckpt_dir))
    rank0 = trainer.rank == 0
    result = trainer.fit(stop_after_steps=args.stop_after_steps)
    if not rank0:
        return
    # per-step loss curve, for comparing runs (resume, world sizes)
    write_json(Path(args.ckpt_dir) / "history.json", trainer.state["history"])
    if args.stop_after_steps is None:
        with replaced_dir(Path(args.out)) as tmp:
            trainer.model.save_pretrained(tmp)
        log_epochs(result["epochs"], Path("dvclive"))
        last = result["epochs"][-1]
        made = made_on(str(trainer.device))
        # loss and the compute dtype: the report (the metrics' columns must fit a terminal)
        write_json(Path(args.metrics), {"val_tau": last["val"]["simulated_tau"], **made})
        write_json(
            Path(args.report),
            {
                "epochs": len(result["epochs"]),
                "steps": trainer.state["global_step"],
                "world_size": result["world_size"],
                "train_loss": last["train"]["loss"],
                "val_loss": last["val"]["loss"],
                "val_acc_per_step": last["val"]["acc_per_step"],
                "val_simulated_tau": last["val"]["simulated_tau"],
                "train_simulated_tau": last["train"]["simulated_tau"],
                **made,
                "dtype": trainer.compute_dtype,
            },
        )
        write_json(Path(args.timing), {"tokens_per_s": result["tokens_per_s"], "wall_s": result.get("wall_s")})
        # the one place a DVC experiment's speed survives it (its reports/timing stays in its workspace)
        log.info("trained %d epochs: %s tokens/s over %s s", len(result["epochs"]), result["tokens_per_s"],
                 result.get("wall_s"))  # fmt: skip


def log_epochs(epochs: list[dict], out: Path) -> None:
    """DVCLive's metrics and plots of every epoch, written whole once training ends: a resumed run
    logs the epochs its checkpoint had finished too, so the output is the same however the run went
    (and, written in a new directory, never through DVC's links into its cache)."""
    from dvclive import Live

    with replaced_dir(out) as tmp:
        live = Live(str(tmp), dvcyaml=None, save_dvc_exp=False, report=None)
        for s in epochs:
            for split in ("train", "val"):
                live.log_metric(f"{split}/loss", s[split]["loss"])
                live.log_metric(f"{split}/simulated_tau", s[split]["simulated_tau"])
                for k, a in enumerate(s[split]["acc_per_step"]):
                    live.log_metric(f"{split}/acc_step{k}", a)
            live.next_step()
        live.end()


if __name__ == "__main__":
    main()
