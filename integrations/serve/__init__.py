"""raykv as the KV index of Ray Serve LLM's request routing.

``RayKVRouter`` (``integrations.serve.router``) is a Ray Serve ``RequestRouter``: it
computes a request's page hashes as raykv's vLLM connector does, reads where those pages
live on the candidate replicas' nodes from its residency view (kept in the background
from the node actors' residency logs: no call on a request's path), and sends the
request to the replica whose node holds the longest prefix in the nearest tier, weighed
against its queue; power of two choices on any error or a node not heard from. Configure it through
``LLMConfig.deployment_config``'s ``RequestRouterConfig`` with
``request_router_class="raykv.integrations.serve.router:RayKVRouter"`` (``docs/engines.md``).
Importing this package imports neither Ray Serve nor vLLM; ``router`` imports Ray Serve.
"""
