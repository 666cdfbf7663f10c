"""One module per notebook: the few calls the notebook makes, in the order it shows them.

Notebook ``NN_name.ipynb`` is backed by ``dsr1kit.steps.name`` (``00_cluster_check`` →
``steps.cluster_check``, ``10_vllm_inference`` → ``steps.vllm_inference``, ...). This package is the
only reader of a notebook's parameters: each step module turns them into the small typed configs the
library packages own (in one visible function per config), and every step module has the same shape —
``begin``, the calls its cells make, ``memory_plan`` where the step loads a model, one
``verdict(result) -> Verdict``, and ``finish``. A cell holds no logic a test cannot reach.
"""

from __future__ import annotations

from ..run.verdict import FAIL, OK, WARN, StepFailed, Verdict, begin, finish, record

__all__ = ["FAIL", "OK", "WARN", "StepFailed", "Verdict", "begin", "finish", "record"]
