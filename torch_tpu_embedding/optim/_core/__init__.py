"""The optimizer core (private): the one ``RowSparseOptimizer`` every optimizer of the package is.

``base`` (the ``torch.optim.Optimizer``), ``contract`` (slots and the pure per-row rule an optimizer
declares), ``hyperparams``, ``grad_intake`` (a step's row gradients), ``step_gates`` (the step-wide
gates), ``update_paths`` (which update path a table takes, and the paths), ``rule_pipeline`` (what every
path runs around the rule), ``slots``, ``stacked_members`` (per-table behaviour in a stacked group),
``ema``, ``extras`` (the Keras extras) and ``step_values`` (learning rates and counters as device data).
"""
