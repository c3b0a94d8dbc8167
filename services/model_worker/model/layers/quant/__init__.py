"""8-bit weight formats for the linear layers: fp8 blocks and int8 rows, quantizing, and picking the methods."""
