"""The agentic API: reasoning content, tool calls and grammar-constrained outputs (xgrammar), shared by the HTTP
and gRPC front ends. `reasoning` splits `<think>` blocks off the text, `tools` validates tool definitions, renders
them through the chat template and parses MiMo's XML tool calls, `grammar` compiles constraints and masks logits."""
