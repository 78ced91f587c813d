"""kvcr's pure domain: frozen dataclasses and functions over ints and strings, stdlib only."""
