"""The README's commands run as written from a fresh clone: no bare ``python`` (only ``.venv`` has
the project), every ``-m`` module exists, and every override is a key of the configuration that
command composes (Hydra's unknown keys and choices are found here, not by a reader)."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

from pipedream.config.loading import compose_config
from pipedream.errors import ConfigError
from planner.config import compose as compose_planner
from planner.errors import PlannerError

REPO = Path(__file__).resolve().parents[2]
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$")   # <run>, ..., a variable the shell would fill in
COMMAND = re.compile(r"^(\.venv/bin/python |python |scripts/\S+\.(sh|sbatch)\b|[A-Z_]+=\S* |srun |sbatch |torchrun )")
PLAIN_KEYS = {"pipedream.export": ("run_dir", "out", "step", "format", "shard_mb"),
              "pipedream.data.prepare": ("tokenizer", "input", "out", "val_fraction")}


def readme_commands() -> list[str]:
    """Each command of the README's code blocks: continuation lines joined, heredoc bodies and
    output lines left out, a transcript's ``$ `` prompt dropped; a transcript showing a refusal
    (its next line starts with ``error:``) is the example of a bad command, and is left out too."""
    lines = (REPO / "README.md").read_text().splitlines()
    commands, inside, heredoc, pending = [], False, None, ""
    for number, line in enumerate(lines):
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if line.startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        text = pending + line.removeprefix("$ ")
        if text.rstrip().endswith("\\"):
            pending = text.rstrip()[:-1] + " "
            continue
        pending = ""
        marker = re.search(r"<<'(\w+)'", text)
        heredoc = marker.group(1) if marker else None
        refused = line.startswith("$ ") and number + 1 < len(lines) and lines[number + 1].startswith("error:")
        if COMMAND.match(text) and not refused:
            commands.append(text)
    return commands


def words_of(command: str) -> list[str]:
    words = [os.path.expandvars(w) for w in shlex.split(command.split(" > ")[0], comments=True)]
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[:1] == ["srun"] or words[:1] == ["sbatch"]:
        words = words[next(i for i, w in enumerate(words) if not w.startswith("-") and i > 0):]
    return words


def overrides(words: list[str]) -> list[str]:
    return [w for w in words if "=" in w and not w.startswith("-") and not PLACEHOLDER.search(w)]


def check_composes(words: list[str], compose) -> None:
    try:
        compose(overrides(words))
    except (ConfigError, PlannerError) as error:   # a folder named only as an example (model.path=~/my_llama)
        if "model.path" not in str(error):
            raise


COMMANDS = readme_commands()


def test_the_readme_has_commands():
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_runs_as_written(command):
    words = words_of(command)
    assert words and words[0] != "python", f"bare python outside .venv: {command}"
    if words[0] == ".venv/bin/python":
        if words[1] == "-":   # a script on stdin
            return
        assert words[1] == "-m", command
        module = words[2]
        assert importlib.util.find_spec(module) is not None, f"no module {module}: {command}"
        if module == "launcher":
            check_composes(words[3:], compose_config)
        elif module == "planner":
            check_composes(words[3:], compose_planner)
        elif module in PLAIN_KEYS:
            unknown = {w.partition("=")[0] for w in words[3:]} - set(PLAIN_KEYS[module])
            assert not unknown, f"{module} takes no {sorted(unknown)}: {command}"
    elif words[0].startswith("scripts/"):
        assert (REPO / words[0]).is_file(), command
        if words[0] == "scripts/train.sh":
            check_composes(words[1:], compose_config)
