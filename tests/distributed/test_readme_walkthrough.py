"""The README's "Train a Llama" walk-through, run as written in a fresh folder: tokenizer -> prepare ->
plan -> train from the plan -> export -> ``AutoTokenizer`` and ``AutoModelForCausalLM`` ->
``generate``. The commands are the section's bash blocks themselves, so the README cannot drift from
what works."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the walk-through trains a tokenizer: needs the hf extras (pip install .[hf])")
pytest.importorskip("transformers", reason="the walk-through loads the export in transformers: needs the hf extras")

REPO = Path(__file__).resolve().parents[2]
SECTION = "### Train a Llama"
VENV_PYTHON = ".venv/bin/python"   # how the README writes the interpreter, relative to the repository's root
PROMPT = "The for statement"       # the README's generation prompt


def section_bash_blocks(readme: str, heading: str) -> list[str]:
    """The fenced ```bash blocks between ``heading`` and the next heading of the README."""
    lines = readme.splitlines()
    start = lines.index(heading) + 1
    blocks, block, fenced = [], None, False
    for line in lines[start:]:
        if line.startswith("```"):
            fenced = not fenced
            if fenced and line.strip() == "```bash":
                block = []
            elif not fenced and block is not None:
                blocks.append("\n".join(block))
                block = None
        elif fenced and block is not None:
            block.append(line)
        elif not fenced and line.startswith("#"):
            break
    return blocks


def walkthrough_script(folder: Path) -> str:
    """The section's commands; ``.venv/bin/python`` becomes this interpreter where ``folder`` has no venv."""
    blocks = section_bash_blocks((REPO / "README.md").read_text(encoding="utf-8"), SECTION)
    assert blocks, f"README.md has no bash block under {SECTION!r}"
    script = "\n".join(blocks)
    if not (folder / VENV_PYTHON).exists():
        script = script.replace(VENV_PYTHON, shlex.quote(sys.executable))
    return script


def test_section_blocks_are_found():
    readme = "intro\n### Train a Llama\ntext\n```bash\na\n# a comment\nb\n```\n```python\nc\n```\n## Next\n```bash\nd\n```\n"
    assert section_bash_blocks(readme, "### Train a Llama") == ["a\n# a comment\nb"]


def test_readme_llama_walkthrough_runs_as_written(tmp_path):
    script = walkthrough_script(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",   # the hub is never contacted
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"the walk-through failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    plan = json.loads((tmp_path / "plan.json").read_text())
    step = json.loads(max((tmp_path / "runs" / "llama" / "checkpoints").glob("step_*/extra.json")).read_text())
    assert step["plan"]["parallel"] == plan["parallel"]   # the training followed the plan written before it
    export = tmp_path / "llama_hf"
    meta = json.loads((tmp_path / "data" / "tok" / "meta.json").read_text())
    config = json.loads((export / "config.json").read_text())
    assert (export / "tokenizer.json").is_file() and meta["eos_id"] is not None
    assert config["eos_token_id"] == config["bos_token_id"] == meta["eos_id"]
    assert PROMPT in done.stdout, done.stdout[-2000:]
    generated = done.stdout[done.stdout.rindex(PROMPT):]   # the prompt, 40 new tokens, print's newline
    assert len(generated) > len(PROMPT) + 1, done.stdout[-2000:]
