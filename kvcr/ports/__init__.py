"""The interfaces the runner needs from the world, one concern per module (typing.Protocol)."""
