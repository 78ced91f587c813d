"""Types of the C extension built from ``_board.c``."""

def lookup(address: int, layout: tuple[int, ...], keys: list[str], /) -> tuple[list[int], list[int], list[bytes]]: ...
def still(address: int, layout: tuple[int, ...], slots: list[int], gens: list[int], /) -> list[bool]: ...
def copy(
    address: int,
    layout: tuple[int, ...],
    pieces: list[tuple[int, int, int, int, int, int, int]],
    src_slots: list[int],
    dst_slots: list[int],
    gens: list[int],
    /,
) -> list[bool]: ...
