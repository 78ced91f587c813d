"""ControlChannel over pyzmq ROUTER/DEALER, and the KV-event publisher socket. Not built yet: see issue 3."""
