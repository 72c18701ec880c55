"""Host tables of the CP strategies: per (plan, mask, strategy), pure integer math.

What each strategy's runtime needs (ring steps and their tile schedules, Ulysses
permutations, the keys a rank fetches and sends) and what it costs (bytes, visible pairs),
computed on the host from the plan, cached in the plan under one typed key
(:func:`keys.table_key`) and copied to the device once, without a sync. Nothing here
communicates or touches a device tensor; ``varlen_cp.strategies`` runs on these tables.

Modules: ``keys`` (the cache key and device copies), ``holders`` (token sets a kernel call
sees, and the call tables), ``ring`` (p2p), ``ulysses`` (a2a), ``hybrid`` (a2a+p2p),
``selected`` (all_gather and dispatch), ``cost`` (closed-form estimates and
``strategy="auto"``).
"""
