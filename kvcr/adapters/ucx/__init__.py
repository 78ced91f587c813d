"""DataPlane over UCX through ucxx (two-sided tagged sends; ucxx has no RMA). Not built yet."""
