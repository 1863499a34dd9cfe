"""Prefill / decode disaggregation (docs/pd.md): `rule.py` (which positions' KV moves), `transfer.py` (the Mooncake
transfer engine), `prefill.py` (the prefill role: writes KV into a decode worker's pools chunk by chunk),
`decode.py` (the decode role: allocates the pages, asks a prefill worker, then decodes)."""
