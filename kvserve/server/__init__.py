"""The OpenAI-compatible HTTP server (`kvserve serve`): tenants, cache salts, metrics."""
