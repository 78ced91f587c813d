"""Dynamo inventory events, hint producer and worker capability. Not built yet: see issue 5."""
