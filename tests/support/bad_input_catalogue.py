"""The failure catalogue: every bad input the project refuses before launch, as data. Each case is
refused with one ``error:`` line holding ``expect``, exit code 2, and no torchrun or rank process.

tests/unit/test_bad_input_catalogue.py runs every case in-process (the launcher, planner and export
entry points with torchrun's call replaced by a tripwire); tests/distributed/test_bad_input.py runs
the ``END_TO_END`` ones through the real command lines and watches which processes start.
docs/reliability.md lists the same cases by id (a test checks it).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]     # "{tmp}" is the fixture folder (make_fixtures)
    expect: str               # part of the one error line
    tool: str = "launcher"    # launcher | planner | export
    warning: bool = False     # a warning and a normal start, not an error

    def args(self, tmp: Path) -> list[str]:
        argv = [a.replace("{tmp}", str(tmp)) for a in self.argv]
        if self.tool == "launcher" and not any(a.startswith("train.run_dir=") for a in argv):
            argv.append(f"train.run_dir={tmp}/runs/{self.id}")
        return argv


def case(id: str, argv: str, expect: str, tool: str = "launcher", warning: bool = False) -> Case:
    return Case(id, tuple(argv.split()), expect, tool, warning)


CATALOGUE = [
    # keys the config does not have
    case("key-misspelt", "train.step=5", "train.step is not a config key; did you mean train.steps? (keys of train: steps,"),
    case("planner-key-misspelt", "model=gpt_tiny cluster=local_cpu planner.algoritm=harmony",
         "planner.algoritm is not a config key; did you mean planner.algorithm?", tool="planner"),
    # types of the keys the launcher reads itself
    case("pp-not-a-number", "parallel.pp=abc", "parallel.pp = 'abc' must be an integer >= 1"),
    case("pp-null", "parallel.pp=null", "parallel.pp = None must be an integer >= 1"),
    case("split-not-numbers", "parallel.layers_per_stage=[a,b]", "parallel.layers_per_stage=['a', 'b'] must be a list"),
    case("split-scalar", "parallel.layers_per_stage=3", "parallel.layers_per_stage=3 must be a list"),
    case("lr-not-a-number", "train.lr=fast", "train.lr = 'fast' must be a finite number"),
    case("seed-not-a-number", "train.seed=abc", "train.seed = 'abc' must be an integer >= 0"),
    case("grad-clip-not-a-number", "train.grad_clip=yes", "train.grad_clip = 'yes' must be a finite number"),
    case("max-restarts-negative", "launcher.max_restarts=-1", "launcher.max_restarts = -1 must be an integer >= 0"),
    case("bind-cores-shared", "launcher.bind_cores=[[0],[0]]", "core 0 is in two sets"),
    case("bind-cores-count", "launcher.bind_cores=[[0]]", "has 1 core sets for 2 processes on this node"),
    case("node-rank-out-of-range", "launcher.nnodes=2 launcher.node_rank=2", "launcher.node_rank = 2 must be a node"),
    case("min-nodes-above-nnodes", "launcher.nnodes=2 launcher.min_nodes=3", "launcher.min_nodes = 3 must be a node"),
    case("elastic-async-schedule", "launcher.nnodes=2 launcher.min_nodes=1 schedule=2bw",
         "with schedule=2bw is refused: its resume is not exact"),
    case("grace-negative", "launcher.grace_s=-1", "launcher.grace_s = -1 must be >= 0"),
    case("port-out-of-range", "launcher.master_port=70000", "launcher.master_port = 70000 is not a TCP port"),
    # bounds
    case("pp-huge", "parallel.pp=1000000000000", "fewer than pp*vpp = 1000000000000"),
    case("batch-cannot-fit", "train.micro_batch_size=400000 train.global_batch_size=800000",
         "GiB is available"),
    case("timeout-zero", "train.timeout_s=0", "train.timeout_s = 0 must be > 0"),
    case("timeout-negative", "train.timeout_s=-5", "train.timeout_s = -5 must be > 0"),
    case("checkpoint-every-negative", "checkpoint.every=-1", "checkpoint.every = -1 must be an integer >= 0"),
    case("warmup-negative", "train.warmup_steps=-5", "train.warmup_steps = -5 must be an integer >= 0"),
    case("lr-inf", "train.lr=inf", "train.lr = inf must be a finite number"),
    case("lr-nan", "train.lr=nan", "train.lr = nan must be a finite number"),
    case("planner-only-preset", "model=gpt_1.7b", "model=gpt_1.7b is planner-only"),
    case("llama-kv-heads-not-divisor", "model=llama_tiny model.num_kv_heads=3",
         "model.num_kv_heads=3 does not divide model.num_heads=4"),
    case("llama-tp-splits-no-kv-heads",
         "model=llama_tiny model.num_heads=12 model.num_kv_heads=4 model.hidden_size=384 parallel.pp=1 parallel.tp=6",
         "model.num_kv_heads=4 and parallel.tp=6 neither divide the other"),
    case("selective-recompute-no-attention", "model=mlp data=synthetic recompute.granularity=selective",
         "recompute.granularity=selective recomputes attention cores, and model.name=mlp has no attention"),
    case("selective-recompute-fused", "train.models=2 recompute.granularity=selective",
         "recompute.granularity=selective with train.models"),
    case("recompute-unknown", "recompute.granularity=some", "recompute.granularity='some' is not supported"),
    case("recompute-layers-negative", "recompute.granularity=full recompute.num_layers=-1",
         "recompute.num_layers = -1 must be an integer >= 0"),
    case("recompute-layers-without-recompute", "recompute.num_layers=2",
         "recompute.num_layers = 2 needs recompute.granularity=full or selective (got none)"),
    case("planner-recompute-layers-negative", "model=gpt_tiny cluster=local_cpu planner.recompute_num_layers=-1",
         "planner.recompute_num_layers = -1 must be an integer >= 0", tool="planner"),
    case("recompute-layers-async", "schedule=2bw recompute.granularity=full recompute.num_layers=1",
         "recompute.num_layers = 1 with schedule=2bw"),
    case("sequence-parallel-without-tp", "parallel.sequence_parallel=true",
         "parallel.sequence_parallel=true shards the sequence over the tensor-parallel group, but parallel.tp=1"),
    case("sequence-parallel-bert", "model=bert_tiny parallel.tp=2 parallel.sequence_parallel=true",
         "parallel.sequence_parallel=true is not available for model=bert"),
    case("sequence-parallel-odd-sequence", "parallel.tp=2 parallel.sequence_parallel=true model.seq_len=63",
         "splits model.seq_len=63 into parallel.tp=2 parts"),
    case("compile-asynchronous", "train.compile=true schedule=pipedream model.tie_embeddings=false",
         "train.compile=inductor with schedule=pipedream"),
    case("compile-split-backward", "train.compile=true schedule=zb_h2",
         "its backward is split into input- and weight-gradient parts"),
    case("compile-tensor-parallel", "train.compile=true parallel.tp=2",
         "train.compile=inductor with parallel.tp=2"),
    case("compile-unknown-backend", "train.compile=fastest",
         "train.compile='fastest' is not a torch.compile backend"),
    case("models-override-unknown", "train.models=[{momentum:0.9}]", "train.models[0] overrides momentum"),
    case("fusion-groups-not-divisor", "train.models=4 train.fusion_groups=3",
         "train.fusion_groups = 3 must be auto or a positive divisor of the 4 models"),
    case("models-budget-negative", "train.models=2 memory.device_budget_bytes=-5",
         "memory.device_budget_bytes = -5 must be a positive number of bytes"),
    case("distributed-optimizer-async", "schedule=pipedream model.tie_embeddings=false optim.distributed=true",
         "optim.distributed=zero1 needs a flush schedule"),
    case("grad-bucket-zero", "train.grad_bucket_mb=0", "train.grad_bucket_mb = 0 must be > 0"),
    # data, checked on the launcher side
    case("text-empty-file", "data=text_file data.path={tmp}/empty.txt", "is empty"),
    case("text-shorter-than-a-sample", "data=text_file data.path={tmp}/short.txt",
         "holds 9 tokens, fewer than one sample of data.seq_len+1 = 65"),
    case("text-empty-folder", "data=text_file data.path={tmp}/emptydir", "is an empty folder"),
    case("text-not-utf8", "data=text_file data.path={tmp}/binary.txt launcher.dry_run=true",
         "256000 bytes are read as U+FFFD", warning=True),
    case("tokens-no-val-bin", "data=token_bin data.path={tmp}/tokens_no_val", "has no val.bin"),
    case("tokens-odd-size", "data=token_bin data.path={tmp}/odd.bin", "holds 20001 bytes, an odd count"),
    case("tokens-empty", "data=token_bin data.path={tmp}/empty.bin", "is empty"),
    case("tokens-too-short", "data=token_bin data.path={tmp}/short.bin", "holds 9 tokens, fewer than one sample"),
    case("tokens-id-too-large", "data=token_bin data.path={tmp}/big_ids.bin",
         "holds token id 300 >= model.vocab_size=256"),
    case("tokens-vocab-over-model", "data=token_bin data.path={tmp}/tokens_big_vocab",
         "records a tokenizer vocabulary of 70000 tokens, more than model.vocab_size=256: set model.vocab_size=70000"),
    case("pydoc-vocab-below-bytes", "data=pydoc model.vocab_size=128",
         "data=pydoc (byte-level tokens, 0..255) holds token id"),
    case("text-vocab-below-bytes", "data=text_file data.path={tmp}/short.txt model.vocab_size=100",
         "holds token id 119 >= model.vocab_size=100: raise model.vocab_size to at least 256"),
    # resume and outputs
    case("resume-missing", "train.resume={tmp}/nonexistent", "does not exist"),
    case("resume-truncated", "train.resume={tmp}/ckpt_truncated/step_00000002", "is missing or truncated"),
    case("resume-bad-marker", "train.resume={tmp}/ckpt_bad_marker/step_00000002", "unreadable COMMITTED marker"),
    case("resume-marker-without-files", "train.resume={tmp}/ckpt_no_files/step_00000002",
         "COMMITTED marker without its step and file list"),
    case("resume-bit-flip", "train.resume={tmp}/ckpt_bit_flip/step_00000002", "does not match its checksum"),
    case("resume-zero-filled", "train.resume={tmp}/ckpt_zero_filled/step_00000002",
         "shard.distcp does not match its checksum"),
    case("resume-corrupt-metadata", "train.resume={tmp}/ckpt_bad_metadata/step_00000002",
         ".metadata does not match its checksum"),
    case("resume-other-model", "train.resume={tmp}/ckpt_other_model/step_00000001",
         "parameter layers.0.wte.weight has shape [256, 64] there but [256, 128] in this model"),
    case("resume-auto-other-model", "train.resume=auto train.run_dir={tmp}/other_model_run",
         "train.resume=auto found"),
    case("resume-run-folder", "train.resume={tmp}/ckpt_bit_flip_run", "is a run or checkpoint folder, not one checkpoint"),
    case("run-dir-is-a-file", "train.run_dir={tmp}/a_file", "is a file, not a folder"),
    case("run-dir-under-a-file", "train.run_dir={tmp}/a_file/run", "sits under"),
    case("checkpoint-dir-under-a-file", "checkpoint.dir={tmp}/a_file/checkpoints", "sits under"),
    case("run-dir-reused", "train.run_dir={tmp}/used_run", "already holds another run's outputs"),
    case("planner-out-unwritable", "model=gpt_tiny cluster=local_cpu train.global_batch_size=32 "
         "planner.out={tmp}/a_file/plan.json", "planner.out=", tool="planner"),
    case("planner-out-missing-folder", "model=gpt_tiny cluster=local_cpu train.global_batch_size=32 "
         "planner.out={tmp}/no_folder/plan.json", "does not exist", tool="planner"),
    case("planner-reserve-negative", "model=gpt_tiny cluster=local_cpu planner.reserve_gib=-1",
         "planner.reserve_gib=-1 must be a number >= 0", tool="planner"),
    case("harmony-budget-below-a-layer", "model=gpt_tiny cluster=local_cpu train.global_batch_size=8 "
         "planner.algorithm=harmony planner.device_budget_bytes=1000", "alone needs", tool="planner"),
    case("harmony-several-nodes", "model=gpt_tiny cluster=h200_x8 train.global_batch_size=8 planner.algorithm=harmony",
         "plans one server", tool="planner"),
    case("export-step-not-a-number", "run_dir={tmp}/ckpt_bit_flip step=abc", "step=abc is not a step number",
         tool="export"),
    case("export-corrupt-checkpoint", "run_dir={tmp}/ckpt_bit_flip_run step=2", "does not match its checksum",
         tool="export"),
    case("export-format-unknown", "run_dir={tmp}/ckpt_bit_flip format=onnx", "format=onnx is unknown", tool="export"),
    # model=hf: a local transformers folder
    case("hf-path-missing", "model=hf model.path={tmp}/no_model data=synthetic", "does not exist or is not a folder"),
    case("hf-architecture-unsupported", "model=hf model.path={tmp}/bert_model data=synthetic",
         "describes BertForMaskedLM, which model=hf cannot split into pipeline layers"),
    case("hf-tensor-parallel", "model=hf model.path={tmp}/llama_header_only data=synthetic parallel.tp=2 parallel.pp=1",
         "model=hf has no tensor-parallel form but parallel.tp=2"),
    case("hf-moe-router-jitter", "model=hf model.path={tmp}/mixtral_jitter data=synthetic",
         "router_jitter_noise=0.1: model=hf routes without jitter"),
    # device and optional packages
    case("device-tpu", "cluster.device=tpu", "cluster.device='tpu' is not supported"),
    case("device-cuda-missing", "cluster.device=cuda", "no usable CUDA device"),
    case("tensorboard-missing", "logging.tensorboard=true", "needs the tensorboard package"),
]

# run through the real command lines too (tests/distributed): one of each kind
END_TO_END = ["key-misspelt", "pp-not-a-number", "max-restarts-negative", "pp-huge", "timeout-zero", "lr-inf", "text-empty-file",
              "tokens-no-val-bin", "resume-bit-flip", "resume-run-folder", "run-dir-under-a-file",
              "planner-out-unwritable", "export-step-not-a-number", "device-tpu"]


def _fake_checkpoint(folder: Path, files: dict[str, bytes], step: int = 2) -> Path:
    """A committed checkpoint folder as save_checkpoint leaves it (sizes and CRC-32 in the marker)."""
    from pipedream.checkpoint.integrity import MARKER, manifest

    checkpoint = folder / f"step_{step:08d}"
    checkpoint.mkdir(parents=True)
    for name, data in files.items():
        (checkpoint / name).write_bytes(data)
    (checkpoint / MARKER).write_text(json.dumps({"step": step, **manifest(checkpoint, MARKER)}))
    return checkpoint


def make_fixtures(tmp: Path, other_model_checkpoint: bool = True) -> Path:
    """The files the cases name, under ``tmp``."""
    (tmp / "empty.txt").write_text("")
    (tmp / "short.txt").write_text("hello world")
    (tmp / "emptydir").mkdir()
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 2000)
    (tmp / "tokens_no_val").mkdir()
    (tmp / "tokens_no_val" / "train.bin").write_bytes(b"\x01\x00" * 10000)
    (tmp / "odd.bin").write_bytes(b"\x01" * 20001)
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "short.bin").write_bytes(b"\x01\x00" * 10)
    (tmp / "big_ids.bin").write_bytes(struct.pack("<H", 300) * 20000)
    (tmp / "tokens_big_vocab").mkdir()
    for part in ("train.bin", "val.bin"):
        (tmp / "tokens_big_vocab" / part).write_bytes(struct.pack("<I", 69999) * 1000)
    (tmp / "tokens_big_vocab" / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70000}))
    (tmp / "a_file").write_text("not a folder")
    (tmp / "bert_model").mkdir()
    (tmp / "bert_model" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    llama = tmp / "llama_header_only"   # its config and a weights file with no tensors: enough to be checked
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "max_position_embeddings": 32, "vocab_size": 64, "tie_word_embeddings": False}))
    (llama / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    mixtral = tmp / "mixtral_jitter"   # a Mixtral that routes with jitter noise
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "max_position_embeddings": 32, "vocab_size": 64, "tie_word_embeddings": False,
        "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}))
    (mixtral / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (tmp / "used_run").mkdir()
    (tmp / "used_run" / "metrics.jsonl").write_text('{"step": 1}\n')
    files = {".metadata": bytes(range(200)), "shard.distcp": bytes(range(256)) * 40}
    for name in ("truncated", "bad_marker", "no_files", "bit_flip", "zero_filled", "bad_metadata"):
        _fake_checkpoint(tmp / f"ckpt_{name}", files)
    (tmp / "ckpt_truncated/step_00000002/shard.distcp").write_bytes(files["shard.distcp"][:100])
    (tmp / "ckpt_bad_marker/step_00000002/COMMITTED").write_text("{not json")
    marker = tmp / "ckpt_no_files/step_00000002/COMMITTED"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
    flipped = bytearray(files["shard.distcp"])
    flipped[len(flipped) // 2] ^= 1
    (tmp / "ckpt_bit_flip/step_00000002/shard.distcp").write_bytes(bytes(flipped))
    (tmp / "ckpt_zero_filled/step_00000002/shard.distcp").write_bytes(bytes(len(flipped)))
    (tmp / "ckpt_bad_metadata/step_00000002/.metadata").write_bytes(bytes(200))
    (tmp / "ckpt_bit_flip_run").mkdir()
    (tmp / "ckpt_bit_flip").rename(tmp / "ckpt_bit_flip_run" / "checkpoints")
    (tmp / "ckpt_bit_flip").symlink_to(tmp / "ckpt_bit_flip_run" / "checkpoints")
    if other_model_checkpoint:
        save_other_model_checkpoint(tmp / "ckpt_other_model")
        (tmp / "other_model_run").mkdir()
        (tmp / "other_model_run" / "checkpoints").symlink_to(tmp / "ckpt_other_model")
    return tmp


def save_other_model_checkpoint(folder: Path) -> None:
    """A real DCP checkpoint of gpt_tiny with hidden size 64 (the default is 128), in one process."""
    import torch
    import torch.distributed.checkpoint as dcp

    from models import build_model
    from pipedream.checkpoint.store import layers_module
    from pipedream.checkpoint.integrity import MARKER, manifest
    from tests.support.training_harness import compose_config

    model_cfg = compose_config(["model.hidden_size=64"]).model
    module = layers_module(build_model(model_cfg).build())
    checkpoint = folder / "step_00000001"
    dcp.save({"model": {k: v.detach() for k, v in module.state_dict().items()}}, checkpoint_id=str(checkpoint))
    torch.save({}, checkpoint / "rank0.pt")
    (checkpoint / MARKER).write_text(json.dumps({"step": 1, **manifest(checkpoint, MARKER)}))
