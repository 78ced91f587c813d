"""DataPlane over NIXL (one-sided READ; UCX picks CMA, shm or RDMA). Not built yet: see issue 3."""
