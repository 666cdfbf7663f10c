"""HARI training: the loss (``hari``), the loop (``loop``), checkpoints, ranks (``dist``) and the prefix cache.

Each part reads a small frozen config of its own (``HariLoss``, ``TrainConfig``, ``PrefixConfig``,
``FillConfig``), gathered in ``HariRun`` (``hari_state``) and run by ``hari_run``;
``dsr1kit.steps.hari_configs`` builds them from notebook 20's parameters.
"""
