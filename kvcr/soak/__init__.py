"""Long runs that count: replica processes with SGLang's real host pools and kvcr, a mixed load, a report.

``kvcr soak`` (``kvcr.soak.run``) drives several replicas (``kvcr.soak.replica``), forked from
one process that imported SGLang once (``kvcr.soak.processes``); the fault tests start the same
replicas and do harm to them.
"""
