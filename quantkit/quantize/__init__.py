"""The streaming quantizer: one tensor at a time from a safetensors checkpoint into quantkit shards (run),
with bounded memory, resumable and byte-identical after a kill (shards, manifest), a report per role
(report) and a checker of finished folders (verify)."""
