"""Which model a process serves or trains, read off its command line.

Built-in knowledge of the common inference servers and launchers; config rules run first and
win. Only the command line is used here: it is what `ps` shows anyone on the host anyway.
"""

from __future__ import annotations

import os
import re
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

# Commands that take the model as a positional word after a subcommand: `<command> <subcommand>
# [options] MODEL [options]`, the options parsed the argparse way (see `_positional`).
# text-generation-launcher holds no GPU itself: it starts one `text-generation-server serve
# MODEL_ID --uds-path ...` per shard (TGI's launcher/src/main.rs, shard_manager), and those hold them.
_POSITIONAL_MODEL = {
    "vllm": ("serve",),
    "ollama": ("run", "serve"),
    "text-generation-server": ("serve",),
}
# Options of those commands that take no value (argparse store_true, vLLM's BooleanOptionalAction,
# TGI's and Ollama's bool flags), from their --help: the word after one is not its value. Every
# `--no-<name>` negation takes none either. An option not listed here takes the word after it.
_SWITCHES = frozenset(
    {
        "-h",
        "--help",
        "--version",
        "--trust-remote-code",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--enable-lora",
        "--enable-lora-bias",
        "--fully-sharded-loras",
        "--enable-prompt-adapter",
        "--enable-auto-tool-choice",
        "--enable-reasoning",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--enable-sleep-mode",
        "--enable-prompt-tokens-details",
        "--enable-request-id-headers",
        "--enable-server-load-tracking",
        "--enable-force-include-usage",
        "--enable-log-requests",
        "--enable-log-outputs",
        "--enable-tokenizer-info-endpoint",
        "--skip-tokenizer-init",
        "--disable-log-requests",
        "--disable-log-stats",
        "--disable-sliding-window",
        "--disable-custom-all-reduce",
        "--disable-cascade-attn",
        "--disable-chunked-mm-input",
        "--disable-async-output-proc",
        "--disable-frontend-multiprocessing",
        "--disable-fastapi-docs",
        "--disable-uvicorn-access-log",
        "--calculate-kv-scales",
        "--async-scheduling",
        "--headless",
        "--return-tokens-as-token-ids",
        "--multi-step-stream-outputs",
        "--use-v2-block-manager",
        "--worker-use-ray",
        "--ray-workers-use-nsight",
        "--data-parallel-hybrid-lb",
        "--data-parallel-external-lb",
        "--sharded",
        "--json-output",
        "--verbose",
        "--insecure",
        "--nowordwrap",
        "--think",
        "--hidethinking",
    }
)
# A short option with its value glued on (vLLM's `-O3`) takes no word after it either.
_GLUED_SHORT = re.compile(r"-[A-Za-z][0-9]+")
# A word that is a value though it starts with '-' (`--seed -1`).
_NEGATIVE_NUMBER = re.compile(r"-[0-9.]+")

# llama.cpp's tools load one GGUF file, `-m FILE` / `--model FILE`, or fetch one from the Hugging
# Face hub, `-hf USER/MODEL[:QUANT]` (`-hfr`, `--hf-repo`). The model is the path as given, the
# way a local directory served by vLLM is named: the file's directory often carries its family
# and version, which the bare file stem would lose. `-m` means this only to these commands (to
# Python it names a module).
_LLAMA_CPP = frozenset({"llama-server", "llama-cli", "llama-run", "llama-bench", "llama-embedding"})
_LLAMA_CPP_MODEL_FLAGS = ("-m", "--model", "-hf", "-hfr", "--hf-repo")


def _flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    values = _flag_values(argv, flags, first_only=True)
    return values[0] if values else None


def _flag_values(argv: Sequence[str], flags: Sequence[str], *, first_only: bool = False) -> list[str]:
    """The values given to any of `flags`, in order (`--flag value` or `--flag=value`)."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in flags:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else ""
        if value:
            found.append(value)
            if first_only:
                break
    return found


def _split(cmdline: Sequence[str]) -> list[str]:
    # Some launchers (and the fake) hand us one string with spaces; real /proc gives argv.
    if len(cmdline) == 1 and " " in cmdline[0]:
        return cmdline[0].split()
    return list(cmdline)


def recognise_model(cmdline: Sequence[str]) -> str | None:
    # A directory names the same model with or without its trailing slash: one model, one row.
    model = _recognised(_split(cmdline))
    return (model.rstrip("/") or model) if model else None


def _positional(argv: Sequence[str], start: int) -> str | None:
    """The first word from argv[start] on that is neither an option nor an option's value, as
    argparse reads `vllm serve --port 8000 MODEL` and `vllm serve MODEL --port 8000` alike. An
    option is a word starting with '-'; `--name=value` and `-O3` carry their value, a switch
    (`_SWITCHES`, `--no-<name>`) has none, and any other option takes the next word. So an
    option missing from `_SWITCHES` right before the model takes it for its value: the model is
    then not named (its owner's other processes may name it), never mistaken for another word.
    A word holding '=' is passed over: the further items of a list option."""
    i = start
    while i < len(argv):
        word = argv[i]
        if word == "--":  # the end of options: what follows is positional
            return argv[i + 1] if i + 1 < len(argv) else None
        if not word.startswith("-"):
            if "=" not in word:
                return word
            # `name=path` is an item of a list option (`--lora-modules sql=/loras/sql chat=...`),
            # never a model: no Hugging Face id holds '='.
            i += 1
            continue
        carries_value = "=" in word or _GLUED_SHORT.fullmatch(word) is not None
        switch = word in _SWITCHES or word.startswith("--no-")
        # As argparse reads it, an option-shaped word is never another option's value: an
        # unknown switch before `--port 8000` must not make `8000` the positional.
        follows = argv[i + 1] if i + 1 < len(argv) else ""
        next_is_option = follows.startswith("-") and _NEGATIVE_NUMBER.fullmatch(follows) is None
        i += 1 if carries_value or switch or next_is_option else 2
    return None


def _recognised(argv: list[str]) -> str | None:
    if not argv:
        return None
    words = [os.path.basename(a) for a in argv[:4]]
    # `vllm serve MODEL`, `ollama run MODEL` and TGI's shards take the model as a positional argument.
    for i, word in enumerate(words):
        commands = _POSITIONAL_MODEL.get(word, ())
        if i + 1 < len(argv) and argv[i + 1] in commands:
            model = _positional(argv, i + 2)
            if model:
                return model
    if any(w in _LLAMA_CPP for w in words):
        return _flag_value(argv, _LLAMA_CPP_MODEL_FLAGS)
    # Triton serves a repository of models; name the repository unless exactly one model is
    # loaded: `--load-model` may be given once per model, and `--load-model=*` loads them all.
    if any(w in ("tritonserver", "triton") for w in words):
        loaded = set(_flag_values(argv, ("--load-model",)))
        if len(loaded) == 1 and "*" not in loaded:
            return loaded.pop()
        repo = _flag_value(argv, ("--model-repository", "--model-store"))
        return os.path.basename(repo.rstrip("/")) if repo else None
    return _flag_value(argv, _MODEL_FLAGS) or _flag_value(argv, _SERVED_NAME_FLAGS)
