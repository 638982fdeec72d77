"""What scripts/bench/runtime.py measures: the workloads (model and batch) and the cases (a runtime
and a schedule) of each, and the order of one round. No torch: the cases are names."""
from __future__ import annotations

from dataclasses import dataclass

from pipedream.schedules import SCHEDULE_INFOS

PP = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# zero-bubble schedules: ours (zb_h2, zbv, dualpipev) and torch's (zbv, interleaved zero bubble,
# DualPipe-V), on the same blocks and batch; torch has no ZB-H2 with one chunk per rank
ZERO_BUBBLE = {"pipedream": ("zb_h2", "zbv", "dualpipev"), "torch": ("zbv", "interleaved_zb", "dualpipev")}
V_PLACED = ("zbv", "dualpipev")          # rank r holds stages r and 2p-1-r
TWO_CHUNKS = ("interleaved", "interleaved_zb", *V_PLACED)
OURS_FOR = {"interleaved_zb": "interleaved"}   # torch only: our config of the same shape
# ours only: torch.distributed.pipelining has no asynchronous schedule
ASYNC_SCHEDULES = tuple(sorted(name for name, info in SCHEDULE_INFOS.items() if info.asynchronous))
BOTH_CORES = "both cores"
STOCK_MODEL = "scripts.bench.runtime_stock_model"


@dataclass(frozen=True)
class Workload:
    """One model and batch shape; ``overrides`` are Hydra overrides of conf/config.yaml."""

    name: str
    overrides: tuple[str, ...]
    micro_batch: int
    microbatches: int
    description: str

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.microbatches


# Our 1f1b again with a runtime optimisation off, to show what each one buys (Hydra overrides).
VARIANTS = {
    "plain autograd": ("train.fuse_grad_accumulation=false", "train.weight_grads_after_send=false"),
    "no send-first": ("train.weight_grads_after_send=false",),
    "no delay": ("train.weight_grads_delay=0",),
    # the global check a clipped step makes before the update (gradient norm over every rank) with a
    # bound no gradient reaches: what post-validation (step first, check after) could save at most
    "global check": ("train.grad_clip=1e9",),
    # the zero-bubble schedules on the stock modules with W holding the Linear GEMMs only (the
    # attention projections' and norms' weight gradients computed in B)
    "no graph split": ("train.split_weight_graphs=false",),
}
CHECKED = ("zb_h2", "zbv")   # on the small GPT, where a synchronisation weighs most


@dataclass(frozen=True)
class Case:
    runtime: str        # pipedream | torch | single
    schedule: str       # gpipe | 1f1b | interleaved | a zero-bubble one ("-" for single)
    variant: str = ""   # a key of VARIANTS (ours only)

    @property
    def name(self) -> str:
        if self.runtime == "single":
            return "single-process" + (f" [{self.variant}]" if self.variant else "")
        return f"{self.runtime} {self.schedule}" + (f" [{self.variant}]" if self.variant else "")

    @property
    def vpp(self) -> int:
        return 2 if self.schedule in TWO_CHUNKS else 1


def workloads(quick: bool) -> list[Workload]:
    common = ("optim=sgd", "train.lr=1e-4", "train.grad_clip=0", "data=synthetic")
    stock = ("optim=sgd", "train.lr=1e-4", "train.grad_clip=0", f"model._target_={STOCK_MODEL}.build",
             f"data._target_={STOCK_MODEL}.data")
    if quick:
        return [Workload("mlp", common + ("model=mlp", "model.num_layers=4", "model.hidden_size=64"), 4, 4,
                         "MLP, 4 blocks, hidden 64 (smoke run)"),
                Workload("stock", stock + ("model.width=16", "model.heads=2", "model.blocks=2", "model.seq_len=8",
                                           "model.vocab=16", "data.vocab=16", "data.seq_len=8"), 2, 4,
                         "torch modules as a plugin, 2 blocks, hidden 16 (smoke run)")]
    return [
        Workload("mlp", common + ("model=mlp", "model.num_layers=8", "model.hidden_size=1024"), 32, 8,
                 "MLP, 8 residual blocks, hidden 1024 (2 Linear 1024x1024 each)"),
        Workload("gpt", common + ("model=gpt_tiny", "model.num_layers=4", "model.hidden_size=128",
                                  "model.num_heads=4", "model.seq_len=64", "model.tie_embeddings=false",
                                  "model.dropout=0.0"), 8, 8,
                 "GPT, 4 blocks, hidden 128, 4 heads, sequence 64, byte vocabulary, untied embeddings"),
        # torch's own modules through the plugin path: [embedding, 4 encoder blocks, LayerNorm, Linear];
        # the default split (equal estimated cost) gives each rank two blocks, round-robin and V alike
        Workload("stock", stock, 8, 8,
                 "torch modules as a plugin: nn.Embedding, 4 nn.TransformerEncoderLayer (hidden 128, 4 heads, "
                 "feed-forward 512), nn.LayerNorm + nn.Linear head; sequence 64, vocabulary 256"),
    ]


def cases(workload: str = "mlp", targets_only: bool = False) -> list[Case]:
    """Every case of a workload, or with ``targets_only`` those the targets compare: the single
    process (alone and on both cores) and every flush and zero-bubble schedule of ours and torch's."""
    flush = [Case(r, s) for s in SCHEDULES for r in ("pipedream", "torch")]
    zero_bubble = [Case(runtime, s) for runtime, names in ZERO_BUBBLE.items() for s in names]
    # the single process again with a second copy running on the other core at the same time:
    # how fast one core computes while both work, which the ideal assumes to be as fast as alone
    single = [Case("single", "-"), Case("single", "-", BOTH_CORES)]
    if targets_only:
        return single + flush + zero_bubble
    checked = [Case("pipedream", s, "global check") for s in CHECKED] if workload == "gpt" else []
    unsplit = [Case("pipedream", s, "no graph split") for s in ZERO_BUBBLE["pipedream"]] if workload == "stock" else []
    return (single + flush + [Case("pipedream", "1f1b", v) for v in VARIANTS if v not in ("global check", "no graph split")]
            + [Case("pipedream", s) for s in ASYNC_SCHEDULES] + zero_bubble + checked + unsplit)


# The cases the targets compare run back to back, so each round's ratios see the same machine speed.
TARGET_CASES = ("torch 1f1b", "pipedream 1f1b", "single-process")


def run_order(names: list[str]) -> list[str]:
    """The order of one round: the target cases first, next to each other, then the rest."""
    return [n for n in TARGET_CASES if n in names] + [n for n in names if n not in TARGET_CASES]
