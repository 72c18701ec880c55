"""Host tables of the CP strategies: per (plan, mask, strategy), pure integer math.

What each strategy's runtime needs (ring steps and their tile schedules, Ulysses
permutations, the keys a rank fetches and sends) and what it costs (bytes, visible pairs),
computed on the host from the plan, cached in the plan and copied to the device once,
without a sync. Nothing here communicates; ``varlen_cp.strategies`` runs on these tables.

Modules, leaves first: ``shape`` (head shape and dtype), ``cost_model`` (machine rates),
``keys`` (the one cache key, device copies; only table functions build keys: strategies
and adapters call them with a ``device``), ``rounds`` (deterministic folds), ``holders``
(token sets a kernel call sees, and the call tables), ``selected`` (the keys each rank's
queries see), ``ring`` (p2p), ``ulysses`` (a2a), ``hybrid`` (a2a+p2p), ``local`` (cp 1),
``staged/`` (dispatch and all_gather: routes, tables, memory, timing), ``cost`` (closed-form
costs per strategy), ``catalogue`` (the strategies: name, overlap, tie rank, costs),
``auto`` (``strategy="auto"``). Imports only go from later to earlier in that list.
"""
