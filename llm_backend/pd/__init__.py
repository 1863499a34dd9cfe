"""Prefill / decode disaggregation (docs/pd.md), engine-side only (no gRPC: that is server/kv_transfer.py):
`rule.py` (which positions' KV moves), `transfer.py` (the Mooncake transfer engine), `prefill.py` (the prefill role:
`PrefillRole`, `PrefillScheduler` writing KV into a decode worker's pools chunk by chunk), `decode.py` (the decode
role: `DecodeRole`, `DecodeScheduler` allocating the pages, having a prefill worker fill them, then decoding)."""
