"""torchtitan 0.3.0 integration: TOML launcher, varlen-cp trainer, the Llama 4 style model and
torchtitan's own models (llama3, qwen3, gpt_oss, deepseek_v3, kimi_k2_7 at CP=1).

Modules: ``cpu_mode`` (CPU switches; import first), ``train`` (the launcher), ``config``
(TOML + command line -> Trainer.Config), ``options`` (the ``[varlen_cp]`` and ``[model]``
sections), ``trainer`` (Trainer subclass: attention swap, prefetched plans, sharding),
``attention`` (inner-attention adapter and its torchtitan ``@override``), ``stock``
(torchtitan's models: selection, layer masks and shapes, limits, CPU fixes), ``model`` /
``llama4_args`` / ``parallelize`` (the Llama 4 style model; its ``[model]`` fields without
torchtitan imports), ``data`` (synthetic packed documents), ``help`` (``--help``: sections
and keys with defaults).
Nothing torchtitan is imported here, so that ``cpu_mode.enable_cpu_mode()`` can run before
torchtitan picks its device, and the launcher can say which extra to install when it is
missing.
"""
