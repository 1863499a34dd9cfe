"""The LLM worker's serving layer: gRPC Generate and the OpenAI-compatible HTTP API over one core.

- `core.py`: prompt preparation (text / ids, media through the encoder) and one running request's
  events, shared by both front ends; `ServeError` carries the gRPC and HTTP statuses;
- `detokenizer.py`: incremental detokenization and stop strings;
- `chat_template.py`: chat templates rendered like transformers' `apply_chat_template`;
- `openai_protocol.py`: request parsing and response shapes; `http.py`: the aiohttp app;
- `grpc_service.py`: `Generator/Generate`; `metrics.py`: Prometheus; `worker.py`: `serve_llm` and the role it
  composes (`build_role`); `kv_transfer.py`: the P/D control channel (`KVTransfer` service, `PrefillClient`);
- `config.py`: `ServerConfig`.
"""
