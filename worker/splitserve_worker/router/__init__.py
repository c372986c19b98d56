"""The router: OpenAI-compatible API, two queues, routing and the KV handoff."""
