"""Secrets from the environment never reach a run folder, a Slurm log or the console.

Parameters cannot hold a secret (``dsr1kit.params`` refuses them), but code a
cell runs can still print one, an exception can carry one, and a server can
log its environment. So every file of a run folder is scanned after the run,
the cell output papermill streams to the job's log is filtered as it goes,
and error messages are masked before they are printed.

A secret is the value of an environment variable whose name has a secret word
as one of its parts (``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``;
not ``TOKENIZERS_PARALLELISM``). Values shorter than ``MIN_SECRET_CHARS`` or
plain flags (``true``, ``none``…) are left alone: masking every "1" would garble
the reports without protecting anything. A value is replaced by as many ``*``
as it has bytes, so a binary file keeps its layout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Mapping

SECRET_ENV_NAME = re.compile(
    r"(?:^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|APIKEY|CREDENTIALS?)(?:$|_)", re.I
)
MIN_SECRET_CHARS = 4
# Not scanned: weights the kit writes from tensors alone (a safetensors file is a JSON header of tensor
# names, dtypes, shapes and offsets, then raw numbers: no environment value gets there), and any file whose
# data has another name (a hard link: a merged checkpoint's unchanged shards are the base model's own). A
# secret's bytes occur in weights by chance (a 4-character value ~160 times in R1's 690 GB): masking them
# would corrupt the weights, and through a link the base checkpoint itself; reading them would re-read the
# whole model after every run.
UNSCANNED_SUFFIXES = (".safetensors",)
NOT_SECRET_VALUES = {"true", "false", "none", "null", "yes", "no", "auto"}
CHUNK = 16 * 2**20


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The environment's secret values, longest first (so a secret containing another is masked whole)."""
    env = os.environ if env is None else env
    values = {
        v
        for k, v in env.items()
        if SECRET_ENV_NAME.search(k) and len(v) >= MIN_SECRET_CHARS and v.lower() not in NOT_SECRET_VALUES
    }
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, values: list[str] | None = None) -> str:
    for v in secret_values() if values is None else values:
        text = text.replace(v, "*" * len(v))
    return text


def redact_file(path: Path, values: list[str]) -> bool:
    """Mask every value in the file, in place, chunk by chunk (any size); True when something was masked."""
    needles = [v.encode() for v in values]
    overlap = max(len(n) for n in needles) - 1
    found = False
    with open(path, "r+b") as f:
        offset = 0
        while True:
            f.seek(offset)
            chunk = f.read(CHUNK + overlap)
            if not chunk:
                break
            masked = chunk
            for n in needles:
                masked = masked.replace(n, b"*" * len(n))
            if masked != chunk:
                found = True
                f.seek(offset)
                f.write(masked)
            if len(chunk) <= CHUNK:
                break
            offset += CHUNK
    return found


def scanned(path: Path) -> bool:
    """A file redaction reads: its own data (no symlink, no hard link), not a weights file (see above)."""
    return (
        path.is_file()
        and not path.is_symlink()
        and not path.name.endswith(UNSCANNED_SUFFIXES)
        and path.stat().st_nlink == 1
    )


def redact_tree(root: Path, values: list[str] | None = None) -> list[str]:
    """Mask secrets in every file under root that ``scanned`` admits (no size limit); the files touched,
    relative to root."""
    values = secret_values() if values is None else values
    if not values:
        return []
    return [
        str(p.relative_to(root))
        for p in sorted(Path(root).rglob("*"))
        if scanned(p) and redact_file(p, values)
    ]


class RedactingFilter(logging.Filter):
    """Masks secrets in a log record's final message (papermill streams cell output through logging)."""

    def __init__(self, values: list[str]):
        super().__init__()
        self.values = values

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact_text(message, self.values)
        if masked != message:
            record.msg, record.args = masked, None
        return True


@contextlib.contextmanager
def redacted_cell_log(logger_name: str = "papermill") -> Iterator[None]:
    """While a notebook runs: cell stderr (papermill's warnings) goes to this process's stderr, i.e. the
    Slurm log, with secrets masked (as Python's last-resort handler showed it before, unmasked)."""
    logger = logging.getLogger(logger_name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RedactingFilter(secret_values()))
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved
