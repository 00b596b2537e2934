"""Which model a process serves or trains, read off its command line.

Built-in knowledge of the common inference servers and launchers; config rules run first and
win. Only the command line is used here: it is what `ps` shows anyone on the host anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# Flags that name a model, as the servers and training scripts spell them.
_MODEL_FLAGS = (
    "--model",
    "--model-id",
    "--model_id",
    "--model-name",
    "--model_name",
    "--model-path",
    "--model_path",
    "--model_name_or_path",
    "--model-name-or-path",
    "--pretrained_model_name_or_path",
)
# The name(s) a server answers to, an alias of the model it loads (vLLM, SGLang): the model only
# where no flag above names the weights, so that one deployment gets one model whatever the order
# of its flags (`vllm serve MODEL --served-model-name ALIAS` names MODEL).
_SERVED_NAME_FLAGS = ("--served-model-name",)

# Commands that take the model as the word after a subcommand: `<command> <subcommand> MODEL`.
# text-generation-launcher holds no GPU itself: it starts one `text-generation-server serve
# MODEL_ID --uds-path ...` per shard (TGI's launcher/src/main.rs, shard_manager), and those hold them.
_POSITIONAL_MODEL = {
    "vllm": ("serve",),
    "ollama": ("run", "serve"),
    "text-generation-server": ("serve",),
}


def _flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in flags:
            if eq:
                return value or None
            if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                return argv[i + 1]
    return None


def _split(cmdline: Sequence[str]) -> list[str]:
    # Some launchers (and the fake) hand us one string with spaces; real /proc gives argv.
    if len(cmdline) == 1 and " " in cmdline[0]:
        return cmdline[0].split()
    return list(cmdline)


def recognise_model(cmdline: Sequence[str]) -> str | None:
    # A directory names the same model with or without its trailing slash: one model, one row.
    model = _recognised(_split(cmdline))
    return (model.rstrip("/") or model) if model else None


def _recognised(argv: list[str]) -> str | None:
    if not argv:
        return None
    words = [os.path.basename(a) for a in argv[:4]]
    # `vllm serve MODEL`, `ollama run MODEL` and TGI's shards take the model as a positional argument.
    for i, word in enumerate(words):
        commands = _POSITIONAL_MODEL.get(word, ())
        if i + 2 < len(argv) and argv[i + 1] in commands and not argv[i + 2].startswith("-"):
            return argv[i + 2]
    # Triton serves a repository of models; name the repository when no model is explicit.
    if any(w in ("tritonserver", "triton") for w in words):
        explicit = _flag_value(argv, ("--load-model",))
        if explicit:
            return explicit
        repo = _flag_value(argv, ("--model-repository", "--model-store"))
        return os.path.basename(repo.rstrip("/")) if repo else None
    return _flag_value(argv, _MODEL_FLAGS) or _flag_value(argv, _SERVED_NAME_FLAGS)
