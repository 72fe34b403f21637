"""`kvserve router`: an OpenAI-compatible front for several replicas, with no torch in its process.

It authenticates at the edge, computes each request's block keys exactly as a replica
would (`tokenizer`, `request`), keeps an index of which replica holds which blocks fed by
their KV events (`index`), picks a replica by cost (`policy`), watches the replicas'
health and load (`replicas`), and forwards the request, retrying it or migrating a cut
stream to another replica (`proxy`, `migration`). `app` is the HTTP front, `metrics` its
Prometheus counters.
"""
