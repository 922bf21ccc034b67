"""What defines a training run besides its data: the `train` section of params.yaml as a typed config
(its one home: no defaults here), and a digest of the code that does the arithmetic. Both are part
of a checkpoint's key, so a run of other settings or other code never resumes it."""

from dataclasses import dataclass, fields
from pathlib import Path

from eaglenest.files.hashing import sha256_file, sha256_text
from eaglenest.runtime.errors import EaglenestError


@dataclass
class TrainConfig:
    """The `train` section of params.yaml, its one home: no defaults here (every stage, test and bench
    states every field); `from_params` names a missing or unknown key."""

    epochs: int
    lr: float
    warmup: float  # fraction of all steps
    weight_decay: float
    grad_clip: float
    ttt_steps: int
    decay: float  # step k's loss weight decay^k
    topk: int  # HASS's top-K distillation term: the teacher's K most likely tokens (0 = off)
    topk_weight: float  # its weight beside the soft CE
    align_topk: int  # token alignment: later steps train only cells still within the drafter's top-N (0 = off)
    batch_tokens: int  # padded tokens per micro-batch
    micro_batches: int  # per optimizer step, over all ranks
    seed: int
    autocast: str  # auto (bf16 where supported) | bf16 | none
    ckpt_every: int  # optimizer steps between checkpoints
    device: str
    attention: str  # auto (flex on CUDA, eager elsewhere) | eager | flex: same math
    compile: str  # auto (on CUDA) | true | false: torch.compile around the attention kernel
    intermediate_size: int | None  # the drafter's MLP width; None = the target's
    loader_workers: int | str  # processes reading the stores: auto (CUDA: 3/4 of a rank's cores; CPU: 0)
    nproc: (
        int | str
    )  # ranks the stage starts under torchrun (eaglenest/runtime/torchrun.py); unused under a hand-run torchrun

    @classmethod
    def from_params(cls, p: dict) -> "TrainConfig":
        names = [f.name for f in fields(cls)]
        missing, unknown = [n for n in names if n not in p], [k for k in p if k not in names]
        if missing or unknown:
            raise EaglenestError(f"train params: missing {missing}, unknown {unknown} (params.yaml `train`)")
        return cls(**{n: p[n] for n in names})


# The modules that define the training arithmetic: this package, the packed reader and the state
# decoding (the train stage's code deps in dvc.yaml: eaglenest/drafter, data/packed.py, store/states.py).
PACKAGE = Path(__file__).parent
TRAINING_CODE = (
    *sorted(p.relative_to(PACKAGE.parent) for p in PACKAGE.glob("*.py")),
    Path("data/packed.py"),
    Path("store/states.py"),
)


def training_code_digest() -> str:
    """sha256 over TRAINING_CODE: a checkpoint made by other training code is never resumed."""
    return sha256_text(*(f"{p}={sha256_file(PACKAGE.parent / p)}" for p in TRAINING_CODE))
