"""`specbatch bench`: recipes over the same prompts at a sweep of batch sizes, against the
memory-bandwidth floor and a transformers peer. `floor` holds the byte counts and the copy
bandwidth, `configs` the random-weight models at real shapes, `sweep` the measurement,
`hf_peer` transformers `generate` on the same weights, `report` the JSON / markdown / PNG."""
