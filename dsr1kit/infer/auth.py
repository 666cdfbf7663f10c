"""The key of a served model, in one place: which environment variable holds it, what a client sends, what the
server the kit starts is given, and what a refused request says.

A key is only ever named (``server_key_env``, ``judge_key_env``: the variable's name) and read from the
environment at the moment it is sent or a process is started; it is never stored in a config, a parameter,
a log, a report or a command line. vLLM reads its key from ``VLLM_API_KEY`` in its own environment (the same
as ``--api-key``, which ``ps`` would show), and guards ``/v1/*`` with it; ``/health`` stays open.
lm-evaluation-harness's ``local-*`` models read theirs from ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import os

SERVER_KEY_VAR = "VLLM_API_KEY"  # the variable vLLM reads as its --api-key
HARNESS_KEY_VAR = "OPENAI_API_KEY"  # the variable lm-eval's local-completions / local-chat-completions read


def key(env: str) -> str:
    """The key held by the variable ``env`` ('' when no variable is named or it is not set)."""
    return os.environ.get(env, "") if env else ""


def headers(env: str) -> dict[str, str]:
    """The bearer header a client sends to an endpoint whose key is in ``env`` (none without a key)."""
    value = key(env)
    return {"Authorization": f"Bearer {value}"} if value else {}


def refused_note(env: str, what: str = "server_key_env") -> str:
    """What a 401/403 means for a client reading its key from ``env``: which variable, and whether it is set."""
    if not env:
        return f"the kit sends no key ({what} is empty): name the variable that holds it in {what}"
    state = "set" if key(env) else "not set"
    return (
        f"the kit sent the key from ${env}, which is {state} in this environment; export the key the server "
        f"demands there (never as a parameter)"
    )


def server_env(env: str, inherited: dict[str, str]) -> dict[str, str]:
    """The environment of a server the kit starts: it demands exactly the key in ``env`` (no key when that is
    unset or '') -- an inherited ``VLLM_API_KEY`` that the kit's clients would not send is not passed on."""
    return _with_key(SERVER_KEY_VAR, env, inherited)


def harness_env(env: str, inherited: dict[str, str]) -> dict[str, str]:
    """The environment of an lm-eval process asking a server whose key is in ``env``: that key as lm-eval's
    ``OPENAI_API_KEY``, and never another (a real OpenAI key of the user's is not sent to a local server)."""
    return _with_key(HARNESS_KEY_VAR, env, inherited)


def _with_key(var: str, env: str, inherited: dict[str, str]) -> dict[str, str]:
    """``inherited`` with ``var`` holding the key in ``env``, or without ``var`` when there is no key."""
    out = {k: v for k, v in inherited.items() if k != var}
    value = key(env)
    if value:
        out[var] = value
    return out
