"""The semantic cache plugin: a paraphrase of an earlier question answered from that question's answer.

Owns the plugin itself (cache.py: `SemanticCache`, the lookup within its deadline and the store after an answer),
what a prompt holds and what vetoes a match (profiles.py, guards.py, roles.py, lexicon.py, vocabulary.py), the
partition key (key.py), the embedder and verifier calls through the gateway's own models, the stores (memory.py,
pgvector.py), and its measurement (`sluice semantic evaluate`: evaluation.py, report.py, command.py, pairs/). It
may import the core; never another plugin.
"""

from plugins.semantic_cache.cache import SemanticCache

__all__ = ["SemanticCache"]
