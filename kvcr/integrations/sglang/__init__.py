"""SGLang HiCache storage backend and hint-forwarding plugin. Not built yet: see issue 4."""
