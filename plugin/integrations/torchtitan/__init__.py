"""torchtitan 0.3.0 integration: TOML launcher, Llama 4 style model, varlen-cp trainer.

Modules: ``cpu_mode`` (CPU switches; import first), ``config`` (TOML -> Trainer.Config),
``model`` / ``parallelize`` (the Llama 4 style model), ``attention`` (inner-attention
adapter), ``data`` (synthetic packed documents), ``trainer`` (Trainer subclass).
Nothing torchtitan is imported here, so that ``cpu_mode.enable_cpu_mode()`` can run before
torchtitan picks its device.
"""
