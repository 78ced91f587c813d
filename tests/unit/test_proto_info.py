"""Reading UCX_PROTO_INFO=y tables: the ucp_get rows to another process, never the "self" ones."""

from kvcr.adapters.nixl.transport_probe import ProtoRow, TransportReport, parse_proto_info

SAMPLE = """\
[1796112106.9] [vm:18627:0]   +--------+-------------+-----------------------------------+
[1796112106.9] [vm:18627:0]   | dstx self cfg#0                                          |
[1796112106.9] [vm:18627:0]   | remote memory read by ucp_get* from host memory to host |
[1796112106.9] [vm:18627:0]   +--------+-------------+-----------------------------------+
[1796112106.9] [vm:18627:0]   | Range  | Description |              Config               |
[1796112106.9] [vm:18627:0]   +--------+-------------+-----------------------------------+
[1796112106.9] [vm:18627:0]   | 0..inf | copy-in     | self/memory                       |
[1796112106.9] [vm:18627:0]   +--------+-------------+-----------------------------------+
2026-12-01 07:54:39 NIXL INFO    _api.py:281 Initialized NIXL agent: x
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   | dstx intra-node cfg#1                                            |
[1796112112.6] [vm:18721:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   | Range  | Description |                  Config                   |
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   |  0..8184 | short     | tcp/lo                                    |
[1796112112.6] [vm:18721:0]   | 8185..inf | zero-copy   | cma/memory                                |
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   | dstx intra-node cfg#1                                            |
[1796112112.6] [vm:18721:0]   | active message by ucp_am_send* from host memory                  |
[1796112112.6] [vm:18721:0]   +--------+-------------+-------------------------------------------+
[1796112112.6] [vm:18721:0]   | 0..inf | zero-copy   | tcp/lo                                    |
"""


def test_only_the_intra_node_get_table_is_read():
    rows = parse_proto_info(SAMPLE + SAMPLE)  # every table prints once per endpoint configuration
    assert rows == (ProtoRow("0..8184", "short", "tcp/lo"), ProtoRow("8185..inf", "zero-copy", "cma/memory"))


def test_the_row_covering_the_read_size_names_the_transport():
    rows = parse_proto_info(SAMPLE)
    small = TransportReport(True, rows, 4096, 1.0, 10.0, 3, True, None, None)
    big = TransportReport(True, rows, 64 << 20, 1.0, 10.0, 3, True, None, None)
    assert (small.transport, big.transport) == ("tcp/lo", "cma/memory")
    assert parse_proto_info("no tables here\n") == ()
    assert ProtoRow("0", "short", "x").covers(0) and not ProtoRow("0", "short", "x").covers(1)
