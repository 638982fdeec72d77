"""``python -m pipedream.export run_dir=runs/<run> [out=model.pt] [step=N]``: consolidates the latest
complete sharded checkpoint of a run into one state dict that the plain single-process model
(``models.build_model(cfg.model).build_sequential()``) loads; also writes ``.safetensors`` when the
safetensors package is installed.

``format=hf out=DIR [shard_mb=2000]`` writes a Hugging Face checkpoint instead (config.json,
generation_config.json, sharded ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``) that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
loads; the model family's ``hf_export`` (``models.registry``) names the conversion. When the run's
data came from ``python -m pipedream.data.prepare``, the tokenizer its ``meta.json`` names is
copied beside the weights (``tokenizer.json``, ``tokenizer_config.json``: ``AutoTokenizer`` loads
the folder) and its BOS/EOS ids go into both configs, so ``generate`` works on the folder as is.

Every file written gets the permissions the umask gives a new file."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream.checkpoint.integrity import checkpoint_problem
from pipedream.checkpoint.plain import NotPlainFileError, load_plain
from pipedream.multi_model.export import is_fused_state, model_paths, split_models
from pipedream.config.specs import default_checkpoint_root
from pipedream.data.hf_tokenizer import NoTokenizer, RunTokenizer, run_tokenizer, write_tokenizer
from pipedream.errors import unknown_key_problem


class ExportError(ValueError):
    """Nothing to export where asked: the message names the folder and why."""


def checkpoint_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []


def choose_checkpoint(root: Path, step: int | None) -> Path:
    """The step's checkpoint, or the newest intact one (size and checksum of every file), warning about
    newer ones passed over; torch-free, so a bad request fails at once."""
    if step is not None:
        checkpoint = root / f"step_{step:08d}"
        problem = checkpoint_problem(checkpoint)
        if problem:
            raise ExportError(f"step={step}: {checkpoint} is not a usable checkpoint ({problem}): choose another step "
                              f"(present: {', '.join(p.name for p in checkpoint_folders(root)) or 'none'})")
        return checkpoint
    for checkpoint in reversed(checkpoint_folders(root)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        print(f"warning: checkpoint {checkpoint} is unusable ({problem}): skipped", file=sys.stderr)
    raise ExportError(f"no complete, intact checkpoint in {root}: train with checkpoint.every=N first")


def consolidate(checkpoint: Path) -> dict[str, Any]:
    """Global names ``layers.<i>.<param>`` become the single-process model's ``<i>.<param>``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(checkpoint), str(merged))
        state = load_plain(merged)
    model = state["model"]
    return {key.removeprefix("layers."): value for key, value in sorted(model.items())}


def export(run_dir: Path, out: Path | None = None, step: int | None = None) -> list[Path]:
    checkpoint = choose_checkpoint(default_checkpoint_root(run_dir), step)
    import torch   # after the choice: a bad request fails at once
    state = consolidate(checkpoint)
    out = out or run_dir / "model.pt"
    if is_fused_state(state):   # a fused set (train.models): one file per model, model_<k>.pt
        models = split_models(state)
        return [path for model, path in zip(models, model_paths(out, len(models))) for path in _save(model, path)]
    return _save(state, out)


def checkpoint_config(checkpoint: Path, section: str) -> dict[str, Any]:
    """A section of the config of the run that saved ``checkpoint`` (its ``extra.json`` records the run)."""
    return dict(json.loads((checkpoint / "extra.json").read_text())["config"][section])


def checkpoint_model_config(checkpoint: Path) -> dict[str, Any]:
    return checkpoint_config(checkpoint, "model")


def hf_converter(model_cfg: dict[str, Any]) -> Any:
    """The family's ``to_hf``; one ExportError line for a model without a Hugging Face form."""
    from models.family import resolve
    from models.registry import known_family
    family = known_family(model_cfg.get("name"))
    if family is None or family.hf_export is None:
        name = model_cfg.get("name") or f"{model_cfg.get('_target_')} (a plugin)"
        raise ExportError(f"model={name} has no Hugging Face form: format=hf exports model=hf and the families "
                          f"that declare hf_export (docs/models.md); use format=torch")
    return resolve(family.hf_export)


SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class HfExport:
    files: list[Path]
    no_tokenizer: str | None   # why no tokenizer was copied, or None


def special_token_ids(tokenizer: RunTokenizer | None, hf_config: dict[str, Any]) -> dict[str, Any]:
    """bos/eos ids for config.json and generation_config.json: the data tokenizer's; without one, the
    converter's (model=hf keeps its original's), else null, lest transformers' per-model defaults (a
    LlamaConfig's 1 and 2) stop generation at an arbitrary token."""
    if tokenizer is not None:
        return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    return {key: hf_config.get(key) for key in SPECIAL_TOKEN_KEYS}


def new_file_mode() -> int:
    """The permissions ``open`` gives a new file (0o666 less the umask): safetensors writes a private
    temporary file and renames it, which would leave its files 0o600."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_json(path: Path, record: dict[str, Any]) -> Path:
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_shards(hf_state: dict[str, Any], out: Path, shard_mb: float) -> list[Path]:
    """``model-0000k-of-0000n.safetensors`` of at most ``shard_mb`` MiB each and their index."""
    from safetensors.torch import save_file

    shards = shard_tensors(hf_state, int(shard_mb * 2**20))
    written, weight_map, mode = [], {}, new_file_mode()
    for k, shard in enumerate(shards, start=1):
        path = out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        # safetensors refuses tensors that share memory: store independent copies
        save_file({key: value.contiguous().clone() for key, value in shard.items()}, str(path),
                  metadata={"format": "pt"})
        path.chmod(mode)
        weight_map.update({key: path.name for key in shard})
        written.append(path)
    total = sum(value.numel() * value.element_size() for value in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return written + [write_json(out / "model.safetensors.index.json", index)]


def export_hf(run_dir: Path, out: Path, step: int | None = None, shard_mb: float = 2000.0) -> HfExport:
    """A Hugging Face checkpoint of the run's model in ``out``: config.json, generation_config.json,
    the shards and their index, and the data's tokenizer when it has one."""
    checkpoint = choose_checkpoint(default_checkpoint_root(run_dir), step)
    model_cfg = checkpoint_model_config(checkpoint)
    to_hf = hf_converter(model_cfg)
    if importlib.util.find_spec("safetensors") is None:
        raise ExportError("format=hf needs the safetensors package: pip install .[hf]")
    try:
        tokenizer, no_tokenizer = run_tokenizer(checkpoint_config(checkpoint, "data")), None
    except NoTokenizer as reason:
        tokenizer, no_tokenizer = None, str(reason)
    state = consolidate(checkpoint)
    if is_fused_state(state):
        raise ExportError("format=hf exports one model; this run trained a fused set (train.models): use format=torch")
    hf_config, hf_state = to_hf(state, model_cfg)
    token_ids = special_token_ids(tokenizer, hf_config)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(out / "config.json", hf_config | token_ids),
               write_json(out / "generation_config.json", token_ids)]
    written += write_shards(hf_state, out, shard_mb)
    if tokenizer is not None:
        written += write_tokenizer(tokenizer, out)
    return HfExport(written, no_tokenizer)


def shard_tensors(state: dict[str, Any], shard_bytes: int) -> list[dict[str, Any]]:
    """Consecutive groups of tensors, each at most ``shard_bytes`` unless one tensor alone is larger."""
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    return shards


def _save(state: dict[str, Any], out: Path) -> list[Path]:
    import torch
    torch.save(state, out)
    written = [out]
    try:
        from safetensors.torch import save_file
    except ImportError:
        return written
    # safetensors refuses tensors that share memory (a tied head): store independent copies
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out.with_suffix(".safetensors")))
    out.with_suffix(".safetensors").chmod(new_file_mode())
    return written + [out.with_suffix(".safetensors")]


USAGE = ("usage: python -m pipedream.export run_dir=RUN_DIR [out=FILE] [step=N] | "
         "run_dir=RUN_DIR format=hf out=DIR [shard_mb=2000] [step=N]")
TORCH_FORMAT, HF_FORMAT = "torch", "hf"   # format=: one state dict, or a Hugging Face checkpoint folder
FORMATS = (TORCH_FORMAT, HF_FORMAT)
KEYS = ("run_dir", "out", "step", "format", "shard_mb")


def _argument_problem(args: dict[str, str]) -> str | None:
    step, fmt, shard_mb = args.get("step"), args.get("format", TORCH_FORMAT), args.get("shard_mb")
    if step is not None and not step.isdigit():
        return (f"step={step} is not a step number: give the N of a step_0000000N folder, or leave step out "
                f"for the newest")
    if fmt not in FORMATS:
        return f"format={fmt} is unknown: choose torch (one state dict) or hf (a Hugging Face checkpoint folder)"
    if shard_mb is not None:
        try:
            positive = float(shard_mb) > 0
        except ValueError:
            positive = False
        if fmt != HF_FORMAT or not positive:
            return f"shard_mb={shard_mb}: give a positive size in MiB, with format=hf only"
    return None


def describe_hf_export(out: Path, exported: HfExport) -> str:
    shards = sum(path.suffix == ".safetensors" for path in exported.files)
    names = [path.name for path in exported.files if path.suffix != ".safetensors"]
    return f"wrote {out}: {', '.join(names)}, {shards} safetensors shard(s)"


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = [k for k in args if k not in KEYS]
    if unknown:
        print(f"error: {unknown_key_problem(unknown[0], KEYS, 'pipedream.export')}", file=sys.stderr)
        return 2
    if any("=" not in a for a in argv) or "run_dir" not in args:
        print(USAGE, file=sys.stderr)
        return 2
    problem = _argument_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    step = None if args.get("step") is None else int(args["step"])
    try:
        if args.get("format") == HF_FORMAT:
            out = Path(args["out"]) if "out" in args else Path(args["run_dir"]) / "hf"
            exported = export_hf(Path(args["run_dir"]), out, step, float(args.get("shard_mb", 2000)))
            print(describe_hf_export(out, exported))
            if exported.no_tokenizer:
                print(f"note: no tokenizer in {out}: {exported.no_tokenizer}")
            return 0
        written = export(Path(args["run_dir"]), Path(args["out"]) if "out" in args else None, step)
    except (ExportError, NotPlainFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
